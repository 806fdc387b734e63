// Output/LSE CUDA kernels (see output/direct.cu), part 2: the flag-in-data protocols - the LL kernel (small
// T; the default there) and the LL128 kernel (a band of T) - where every word or line carries the call's flag.
#pragma once

#include "params.cuh"

namespace {

// ------------------------------------------------------------------------------------------------ LL
// Small T: the same units, CTAs and epochs, but every payload/LSE word carries the call's flag
// (f = 2*epoch + 1, odd so never the zero of fresh memory, and different from the slot's previous
// use, epoch - 2). Layout in the inbox at ll_off, in 8-byte LL words {data, flag}:
//   [2 slots][W src][ll_max_tokens][rowLL],  rowLL = H*D/2 payload words + H LSE words (+1 pad if H odd)
// A 16-byte payload vector travels as two 16-byte stores {d0,f,d1,f} {d2,f,d3,f}. The consumer polls its
// own lines (bounded) until every flag matches, then combines. No fence, no flag round trip; twice the
// bytes on the wire, so it pays only for small T (the host picks it for T <= ll_max_tokens).
// Two slots suffice by the plain kernel's argument; LL and plain calls use separate regions, and the
// argument holds per region (the last reader of a region slot finished before the writer's previous call).
template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock) output_direct_ll_kernel(const __grid_constant__ OutputKernelParams p) {
  constexpr bool kEarly = (kVar & kVarEarly) != 0;
  const int stages = (kVar & kVarStages) ? p.stages : 0;  // the default build has no stage checks
  if ((kVar & kVarStages) && (stages & kStageEmpty)) return;
  pdl_enter<kVar>();
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const Geo g = make_geo(p, prog);
  PubRound pr;
  LseItem li;
  early_loads<kVar>(p, g, prog, pr, li);
  __shared__ int64_t s_epoch;
  advance_epoch(p, prog, &s_epoch);
  __syncthreads();
  const int64_t e = s_epoch;
  const int slot = static_cast<int>(e & 1);
  const uint32_t f = static_cast<uint32_t>(2 * e + 1);
  const int W = g.W, H = g.H, rank = g.rank;
  const int NC = g.NC, UV = g.UV, VH = g.VH;
  const int64_t HV = g.HV, WHV = g.WHV;
  if (prog >= g.n_units) return;
  const int64_t rowLL = int64_t(H) * (p.D >> 1) + H + (H & 1);  // 8-byte LL words per (slot, src, token)
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  const int64_t my_row0 = int64_t(slot * W + rank) * p.ll_max_tokens;

  // ---- publish payload lines: vector off = 4 data words = 2 lines (16 B) of the LL row
  if (!(stages & kSkipPayload)) {
    for (int i0 = tid; i0 < g.pub_items; i0 += kBlock * kPubUnroll) {
      if (!kEarly || i0 != tid) pub_load(p, g, prog, i0, pr);
#pragma unroll
      for (int k = 0; k < kPubUnroll; ++k) {
        if (pr.d[k] >= 0) {
          uint4* dst = reinterpret_cast<uint4*>(reinterpret_cast<uint2*>(p.peer_base[pr.d[k]] + p.ll_off) +
                                                (my_row0 + pr.t[k]) * rowLL) +
                       2 * pr.off[k];
          peerdcp::st_volatile_v4(dst, pr.v[k].x, f, pr.v[k].y, f);
          peerdcp::st_volatile_v4(dst + 1, pr.v[k].z, f, pr.v[k].w, f);
        }
      }
    }
  }
  if (!(stages & kSkipLse)) {
    for (int i = tid; i < g.lse_items; i += kBlock) {
      if (!kEarly || i != tid) lse_load(p, g, prog, i, li);
      if (li.d >= 0) {
        uint2* dl = reinterpret_cast<uint2*>(p.peer_base[li.d] + p.ll_off) + (my_row0 + li.t) * rowLL +
                    int64_t(H) * (p.D >> 1) + li.h;
        peerdcp::st_volatile_v2(dl, __float_as_uint(li.v), f);
      }
    }
  }

  // ---- combine: own data from the input, the others polled out of the LL lines (bounded)
  // (breakdown: a skipped stage is neither published nor polled; kSkipSync reads each line once)
  const bool poll_pay = !(stages & kSkipPayload), poll_lse = !(stages & kSkipLse), poll = !(stages & kSkipSync);
  const bool do_combine = !(stages & kSkipCombine);
  const int comb_items = g.my_units * UV;
  const uint2* in_ll = reinterpret_cast<const uint2*>(p.peer_base[rank] + p.ll_off);
  int dead = 0;  // sources this thread already gave up on: one timeout per source, not one per item
  for (int i = tid; i < comb_items; i += kBlock) {
    int t, h, j;
    if (!decode_item(p, prog, NC, UV, comb_items, i, t, h, j)) continue;
    float own_l = 0.f;
    uint4 own_v = make_uint4(0, 0, 0, 0);
    if (do_combine) {
      own_l = __ldg(p.partial_lse + int64_t(t) * W * H + rank * H + h);
      own_v = __ldg(src + t * WHV + rank * HV + int64_t(h) * VH + j);
    }
    float l[WMAX];
    uint4 x[WMAX];
#pragma unroll
    for (int s = 0; s < WMAX; ++s) {
      if (s < W && s != rank) {
        const uint2* row = in_ll + (int64_t(slot * W + s) * p.ll_max_tokens + t) * rowLL;
        const uint4* line = reinterpret_cast<const uint4*>(row) + 2 * (int64_t(h) * VH + j);
        const uint2* lw = row + int64_t(H) * (p.D >> 1) + h;
        auto arrived = [&](const uint4& a, const uint4& b, const uint2& c) {
          if (kVar & kVarStages) {
            return !poll || ((!poll_pay || (a.y == f && a.w == f && b.y == f && b.w == f)) && (!poll_lse || c.y == f));
          }
          return a.y == f && a.w == f && b.y == f && b.w == f && c.y == f;
        };
        uint4 a = peerdcp::ld_volatile_v4(line), b = peerdcp::ld_volatile_v4(line + 1);
        uint2 c = peerdcp::ld_volatile_v2(lw);
        bool ready = arrived(a, b, c);
        if (!ready && !((dead >> s) & 1)) {  // (peerdcp::spin_until's loop, written out: see peer_memory.cuh)
          const uint64_t t0 = peerdcp::global_timer_ns();
          int spins = 0;
          while (!ready) {
            a = peerdcp::ld_volatile_v4(line);
            b = peerdcp::ld_volatile_v4(line + 1);
            c = peerdcp::ld_volatile_v2(lw);
            ready = arrived(a, b, c);
            if (!ready && ++spins == 64) {
              spins = 0;
              if (static_cast<int64_t>(peerdcp::global_timer_ns() - t0) > p.timeout_ns) break;
            }
          }
          if (!ready) {  // timed out: this source counts as empty; the host raises at the next call
            dead |= 1 << s;
            peerdcp::report_timeout(p.err, rank, s, p.mech, call_flag(e, p.T));
          }
        }
        l[s] = ready ? __uint_as_float(c.x) : -INFINITY;
        x[s] = ready ? make_uint4(a.x, a.z, b.x, b.z) : make_uint4(0, 0, 0, 0);
      }
    }
    if (do_combine) combine_store<scalar_t, WMAX>(p, own_l, own_v, l, x, t, h, j);
  }
}

// ---------------------------------------------------------------------------------------------- LL128
// Medium and large T (opt-in `kOptLL128`, used for T > ll_max_tokens): NCCL's LL128 idea. The payload row
// of a (slot, source, token) travels as 128-byte lines of 16 eight-byte words: lanes 8q..8q+7 of a warp
// store one line with one 16-byte st.volatile each, words 0..14 carry data and word 15 (lane 7's upper
// half) carries the call's 64-bit flag value fv. The reader loads the line the same way (8 lanes, one
// 16-byte ld.volatile each) and takes it once lane 7 sees fv: no fence, no separate flag round trip, and
// each line is combined as soon as it is there, so the combine overlaps the transfer of later lines.
// 1/16 of the bytes are flags (LL: 1/2).
//
// ASSUMPTION (not in the PTX memory model; the one NCCL's LL128 protocol makes, and enables by default on
// NVLink Hopper): a 128-byte-aligned line written by 8 lanes of one warp store instruction becomes visible
// to a reader's 8-lane load of the same line all at once, never torn. Every line store here is that one
// instruction: the flag word is chosen by a select (no divergent store), and a line's 8 lanes are valid or
// invalid together. That is why it is opt-in: the plain kernel (release flag after a fence) assumes only
// the PTX model. A torn line would show up as wrong rows in the graph-replay tests with changing inputs.
//
// MEASURED (2 x H200, bench.output --quick, Kimi, graph): correct (10,000 graph replays with
// changing inputs, 0 mismatches, vmm and symm; adversarial LSEs; missing peer -> PeerTimeoutError) but not
// faster than the plain kernel where it was meant to help: T = 128 13.4-14.5 us vs 13.3, T = 256 26-27 us
// vs 22.1; up to about 0.5 us faster at T = 32. Tried without a gain: one line per thread per round,
// kCU lines per round (kept), weak instead of volatile line stores (kept; no difference), split producer /
// consumer warps (T = 128 17.4 us, left off), flag-only polling with __nanosleep back-off (slightly worse,
// not kept). With PDL: 6.55 us at T = 32 vs 7.13 for the plain kernel, but 6.38 vs 5.34 at T = 16, 9.1 vs 9.2
// at T = 64, 26.0 vs 21.7 at T = 256; a T scan puts the gain at 24 <= T <= 48. The sentinel kernel is faster
// there (5.5 vs 6.5 us at T = 24), so the host's LL128 band is off by default (OutputPolicy
// .cuda_ll128_max_tokens). Not measured: a stage breakdown (publish vs the link).
//
// Layout at ll128_off, in 8-byte words: [2 slots][W src][ll128_max_tokens][rowW] with
//   rowW = NL*16 + round_up(H, 16), NL = ceil(PW / 15) lines, PW = H*D/4 payload words (2-byte dtype),
//   payload word w (elements 4w..4w+3 of the [H, D] slice) at line w / 15, word w % 15;
//   the LSE of head h as an LL word {lse bits, f} at NL*16 + h (f = 2*epoch + 1, as the LL kernel).
// Partition: the T*NL lines of a call are split evenly over the G CTAs, the same on every rank; CTA p
// publishes its lines to every destination and combines the same lines of its own heads. LSE words are
// split evenly too, so a line's reader may need an LSE another CTA published: every CTA runs in every
// call (no tight grid with LL128), so every CTA's epoch counts the same calls and all flags agree.
// Two slots suffice by the plain kernel's argument, applied to whole grids (stream order; with PDL,
// griddepcontrol.wait precedes every access): A writes slot n%2 in call n after its call n-1 completed,
// which read B's call-(n-1) lines, which B published after its call n-2 (the last reader of the slot)
// completed. The region is separate from the LL and plain ones; the argument holds per region.
// Flags: fv = epoch * 2^20 + T differs from the slot's previous value (epoch - 2) and from fresh zeros.
constexpr int kLineWords = 16;  // 8-byte words per 128-byte line
constexpr int kLineData = 15;   // data words per line (word 15 is the flag)
constexpr unsigned kFullMask = 0xffffffffu;
// Warp roles. Split (half the warps publish, half combine, no barrier between) was measured slower on
// H200 (T = 128: 17.4 vs 13.5 us), so every thread publishes, then combines.
constexpr bool kLL128SplitRoles = false;
constexpr int kProducers = kLL128SplitRoles ? kBlock / 2 : kBlock;  // threads (whole warps) that publish
constexpr int kConsumers = kLL128SplitRoles ? kBlock - kProducers : kBlock;
constexpr int kConsumer0 = kLL128SplitRoles ? kProducers : 0;        // first combining thread

struct Ll128Geo {
  int PW, NL, lines, lo, hi;  // payload words per slice, lines per row, lines of the call, this CTA's [lo, hi)
  int64_t rowW;               // 8-byte words per (slot, src, token) row
};

__device__ __forceinline__ Ll128Geo make_ll128_geo(const OutputKernelParams& p, int prog) {
  Ll128Geo g;
  g.PW = p.H * (p.D >> 2);
  g.NL = (g.PW + kLineData - 1) / kLineData;
  g.rowW = int64_t(g.NL) * kLineWords + ((p.H + 15) & ~15);
  g.lines = p.T * g.NL;  // the host keeps ll128_max_tokens * NL * 8 * W < 2^31
  g.lo = static_cast<int>((int64_t(g.lines) * prog) / p.G);
  g.hi = static_cast<int>((int64_t(g.lines) * (prog + 1)) / p.G);
  return g;
}

// 4 elements (one 8-byte word): own source (own_l, own_w) and the W-1 others (l[j], x[j], source
// s = j + (j >= rank)) -> the combined word; sets m and S. Own term first, then the others (compile-time
// indices only: a source-ordered sum would index the arrays with the runtime rank and spill them).
template <typename scalar_t, int NO>
__device__ __forceinline__ uint2 combine_word(const OutputKernelParams& p, float own_l, uint2 own_w,
                                              const float (&l)[NO], const uint2 (&x)[NO], float& m_out,
                                              float& s_out) {
  using P8 = peerdcp::Pack8<scalar_t>;
  const int n = p.W - 1;
  const float lo = sanitize(own_l);
  float ls[NO];
  float m = lo;
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    ls[j] = j < n ? sanitize(l[j]) : -INFINITY;
    m = fmaxf(m, ls[j]);
  }
  if (m == -INFINITY) m = 0.f;
  float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f, S = 0.f;
  auto add = [&](float lw, uint2 v) {
    const float w = p.base2 ? exp2f(lw - m) : __expf(lw - m);
    S += w;
    if (w > 0.f) {  // select, never 0 * payload
      a0 = fmaf(w, P8::lo(v.x), a0);
      a1 = fmaf(w, P8::hi(v.x), a1);
      a2 = fmaf(w, P8::lo(v.y), a2);
      a3 = fmaf(w, P8::hi(v.y), a3);
    }
  };
  add(lo, own_w);
#pragma unroll
  for (int j = 0; j < NO; ++j) {
    if (j < n) add(ls[j], x[j]);
  }
  const float inv = S > 0.f ? 1.f / S : 0.f;
  m_out = m;
  s_out = S;
  return make_uint2(P8::pack(a0 * inv, a1 * inv), P8::pack(a2 * inv, a3 * inv));
}

template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock, 2) output_direct_ll128_kernel(const __grid_constant__ OutputKernelParams p) {
  pdl_enter<kVar>();
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const int lane = tid & 7;                  // lane within the line's 8-lane group
  const int flag_lane = (tid & 31) | 7;      // the group's lane 7, within the warp
  const Ll128Geo g = make_ll128_geo(p, prog);
  __shared__ int64_t s_epoch;
  advance_epoch(p, prog, &s_epoch);
  __syncthreads();
  const int64_t e = s_epoch;
  const int slot = static_cast<int>(e & 1);
  const int64_t fv = call_flag(e, p.T);
  const uint32_t flo = static_cast<uint32_t>(fv), fhi = static_cast<uint32_t>(static_cast<uint64_t>(fv) >> 32);
  const uint32_t f = static_cast<uint32_t>(2 * e + 1);
  const int W = p.W, H = p.H, rank = p.rank, T = p.T, PW = g.PW, NL = g.NL;
  const int64_t rowW = g.rowW;
  const uint2* src = reinterpret_cast<const uint2*>(p.partial_out);  // 8-byte words
  const int64_t my_row0 = int64_t(slot * W + rank) * p.ll128_max_tokens;

  // Warp roles (kLL128SplitRoles): either every thread publishes and then combines, or warps publish and
  // others combine with nothing ordering the two (producers never wait, so a consumer's wait always ends).
  const bool producer = tid < kProducers;
  const bool consumer = tid >= kConsumer0;
  // ---- 1. LSE words first (few; they travel ahead of the lines that need them)
  {
    const int n_lse = (W - 1) * T * H;
    const int l0 = static_cast<int>((int64_t(n_lse) * prog) / p.G), l1 = static_cast<int>((int64_t(n_lse) * (prog + 1)) / p.G);
    for (int i = l0 + tid; producer && i < l1; i += kProducers) {
      const int dj = i / (T * H);
      const int r = i - dj * T * H;
      const int t = r / H, h = r - (r / H) * H;
      const int d = dj + (dj >= rank);
      const float v = __ldg(p.partial_lse + int64_t(t) * W * H + d * H + h);
      uint2* dl = reinterpret_cast<uint2*>(p.peer_base[d] + p.ll128_off) + (my_row0 + t) * rowW +
                  int64_t(NL) * kLineWords + h;
      peerdcp::st_volatile_v2(dl, __float_as_uint(v), f);
    }
  }

  // ---- 2. payload lines: (destination, line, lane) items, kPubUnroll lines' loads in flight per thread.
  // The line stores are weak st.global.v4: the volatile stores of the LL kernel move 8 MiB in ~50 us at
  // T = 256 (~170 GB/s) where the plain kernel's weak stores reach ~330 GB/s; the one-instruction-per-line
  // rule above is what the protocol needs.
  const int nmine = g.hi - g.lo;
  const int n_pub = (W - 1) * nmine * 8;
  for (int i0 = tid; producer && i0 < n_pub; i0 += kProducers * kPubUnroll) {
    uint2 a[kPubUnroll], b[kPubUnroll];
    uint4* dst[kPubUnroll];
#pragma unroll
    for (int k = 0; k < kPubUnroll; ++k) {
      const int i = i0 + k * kProducers;
      dst[k] = nullptr;
      a[k] = b[k] = make_uint2(0, 0);
      if (i < n_pub) {  // the same for the 8 lanes of a line (kBlock is a multiple of 8)
        const int li = i >> 3;
        const int dj = li / nmine;
        const int gl = g.lo + (li - dj * nmine);
        const int t = gl / NL, L = gl - (gl / NL) * NL;
        const int d = dj + (dj >= rank);
        const int w = L * kLineData + 2 * lane;
        const uint2* s = src + (int64_t(t) * W + d) * PW;
        if (w < PW) a[k] = __ldg(s + w);
        if (lane < 7 && w + 1 < PW) b[k] = __ldg(s + w + 1);
        dst[k] = reinterpret_cast<uint4*>(reinterpret_cast<uint2*>(p.peer_base[d] + p.ll128_off) +
                                          (my_row0 + t) * rowW + int64_t(L) * kLineWords) + lane;
      }
    }
#pragma unroll
    for (int k = 0; k < kPubUnroll; ++k) {
      // one store instruction per line for all 8 lanes: lane 7's upper half is the flag, by a select
      const uint32_t z = lane == 7 ? flo : b[k].x, q = lane == 7 ? fhi : b[k].y;
      if (dst[k] != nullptr) *dst[k] = make_uint4(a[k].x, a[k].y, z, q);  // weak 16-byte store (see above)
    }
  }

  // ---- 3. combine my lines of my heads as they arrive. kCU lines per thread per round: every load of a
  // round (own words and LSEs, every source's line and LSE words) is issued before the first poll, so a
  // round costs about one round trip once the data is there (one line per round was latency-bound).
  constexpr int NO = WMAX - 1;                                     // other sources: s = j + (j >= rank)
  constexpr int kCU = WMAX <= 2 ? 4 : (WMAX <= 4 ? 2 : 1);
  const char* inbox = p.peer_base[rank] + p.ll128_off;
  uint2* out = reinterpret_cast<uint2*>(p.out);
  const int n_cons = nmine * 8;
  int dead = 0;      // sources whose lines timed out (warp-uniform: set only by the warp's collective decision)
  int lse_dead = 0;  // sources whose LSE word timed out for this thread
  for (int base = 0; consumer && base < n_cons; base += kConsumers * kCU) {  // same trip count per warp
    int t[kCU], L[kCU], w[kCU], h0[kCU], h1[kCU];
    bool valid[kCU], has0[kCU], has1[kCU];
    uint2 ow0[kCU], ow1[kCU];
    float ol0[kCU], ol1[kCU];
    uint4 v[kCU][NO];
    uint2 c0[kCU][NO], c1[kCU][NO];
    // (a) decode and issue every load of the round
#pragma unroll
    for (int k = 0; k < kCU; ++k) {
      const int i = base + k * kConsumers + (tid - kConsumer0);
      valid[k] = i < n_cons;  // the same for the 8 lanes of a line
      t[k] = L[k] = w[k] = 0;
      if (valid[k]) {
        const int gl = g.lo + (i >> 3);
        t[k] = gl / NL;
        L[k] = gl - t[k] * NL;
        w[k] = L[k] * kLineData + 2 * lane;
      }
      has0[k] = valid[k] && w[k] < PW;
      has1[k] = valid[k] && lane < 7 && w[k] + 1 < PW;
      h0[k] = has0[k] ? (4 * w[k]) / p.D : 0;
      h1[k] = has1[k] ? (4 * (w[k] + 1)) / p.D : h0[k];
      const uint2* own = src + (int64_t(t[k]) * W + rank) * PW;
      ow0[k] = has0[k] ? __ldg(own + w[k]) : make_uint2(0, 0);
      ow1[k] = has1[k] ? __ldg(own + w[k] + 1) : make_uint2(0, 0);
      const float* own_lse = p.partial_lse + int64_t(t[k]) * W * H + rank * H;
      ol0[k] = has0[k] ? __ldg(own_lse + h0[k]) : -INFINITY;
      ol1[k] = has1[k] ? __ldg(own_lse + h1[k]) : -INFINITY;
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        if (j >= W - 1) break;
        const int s = j + (j >= rank);
        const uint2* row = reinterpret_cast<const uint2*>(inbox) + (int64_t(slot * W + s) * p.ll128_max_tokens + t[k]) * rowW;
        const uint2* lw = row + int64_t(NL) * kLineWords;  // the row's LSE words
        v[k][j] = valid[k] ? peerdcp::ld_volatile_v4(reinterpret_cast<const uint4*>(row + int64_t(L[k]) * kLineWords) + lane)
                           : make_uint4(0, 0, 0, 0);
        c0[k][j] = has0[k] ? peerdcp::ld_volatile_v2(lw + h0[k]) : make_uint2(0, 0);
        c1[k][j] = has1[k] && h1[k] != h0[k] ? peerdcp::ld_volatile_v2(lw + h1[k]) : c0[k][j];
      }
    }
    // (b) wait for what has not arrived yet (lines: warp-collective, bounded; LSE words: per thread, bounded)
#pragma unroll
    for (int k = 0; k < kCU; ++k) {
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        if (j >= W - 1) break;  // uniform
        const int s = j + (j >= rank);
        const uint2* row = reinterpret_cast<const uint2*>(inbox) + (int64_t(slot * W + s) * p.ll128_max_tokens + t[k]) * rowW;
        const uint4* lp = reinterpret_cast<const uint4*>(row + int64_t(L[k]) * kLineWords) + lane;
        const uint2* lw = row + int64_t(NL) * kLineWords;
        bool rdy = __shfl_sync(kFullMask, !valid[k] || (v[k][j].z == flo && v[k][j].w == fhi), flag_lane);
        if (!__all_sync(kFullMask, rdy) && !((dead >> s) & 1)) {
          const uint64_t t0 = peerdcp::global_timer_ns();
          int spins = 0;
          while (true) {
            if (!rdy) v[k][j] = peerdcp::ld_volatile_v4(lp);  // whole line again (never a mix of two reads)
            rdy = __shfl_sync(kFullMask, !valid[k] || (v[k][j].z == flo && v[k][j].w == fhi), flag_lane);
            if (__all_sync(kFullMask, rdy)) break;
            if (++spins == 64) {
              spins = 0;
              const bool late = static_cast<int64_t>(peerdcp::global_timer_ns() - t0) > p.timeout_ns;
              if (__shfl_sync(kFullMask, late, 0)) break;
            }
          }
          if (!__all_sync(kFullMask, rdy)) {  // timed out: source s counts as empty from here on (warp-uniform)
            dead |= 1 << s;
            if ((tid & 31) == 0) peerdcp::report_timeout(p.err, rank, s, p.mech, fv);
          }
        }
        // a line that is not there (dead source) is empty: its LSE is -inf whatever its word holds
        if (!rdy) {
          c0[k][j] = c1[k][j] = make_uint2(0, 0);
          continue;
        }
        auto settle = [&](uint2& c, int h) {
          if (c.y == f || ((lse_dead >> s) & 1)) return;
          peerdcp::spin_until(p.timeout_ns, [&] { return c.y == f; }, [&] { c = peerdcp::ld_volatile_v2(lw + h); });
          if (c.y != f) {
            lse_dead |= 1 << s;
            peerdcp::report_timeout(p.err, rank, s, p.mech, fv);
          }
        };
        if (has0[k]) settle(c0[k][j], h0[k]);
        if (has1[k] && h1[k] != h0[k]) settle(c1[k][j], h1[k]);
        if (h1[k] == h0[k]) c1[k][j] = c0[k][j];
      }
    }
    // (c) combine and store
#pragma unroll
    for (int k = 0; k < kCU; ++k) {
      float l0[NO], l1[NO];
      uint2 x0[NO], x1[NO];
#pragma unroll
      for (int j = 0; j < NO; ++j) {
        l0[j] = c0[k][j].y == f ? __uint_as_float(c0[k][j].x) : -INFINITY;
        l1[j] = c1[k][j].y == f ? __uint_as_float(c1[k][j].x) : -INFINITY;
        x0[j] = make_uint2(v[k][j].x, v[k][j].y);
        x1[j] = make_uint2(v[k][j].z, v[k][j].w);
      }
      float m, S;
      if (has0[k]) {
        out[int64_t(t[k]) * PW + w[k]] = combine_word<scalar_t, NO>(p, ol0[k], ow0[k], l0, x0, m, S);
        if (p.out_lse != nullptr && (4 * w[k]) % p.D == 0) {
          p.out_lse[int64_t(t[k]) * H + h0[k]] = S > 0.f ? m + (p.base2 ? log2f(S) : logf(S)) : -INFINITY;
        }
      }
      if (has1[k]) {
        out[int64_t(t[k]) * PW + w[k] + 1] = combine_word<scalar_t, NO>(p, ol1[k], ow1[k], l1, x1, m, S);
        if (p.out_lse != nullptr && (4 * (w[k] + 1)) % p.D == 0) {
          p.out_lse[int64_t(t[k]) * H + h1[k]] = S > 0.f ? m + (p.base2 ? log2f(S) : logf(S)) : -INFINITY;
        }
      }
    }
  }
}

}  // namespace
