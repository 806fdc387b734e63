// Output/LSE CUDA kernels (see output/direct.cu), part 4: the sentinel kernel (the default above the LL range):
// the payload needs no flag at all, because a slot at rest holds a bit pattern no published word has.
#pragma once

#include "params.cuh"

namespace {

// ------------------------------------------------------------------------------------------- sentinel
// Why: at large T the plain kernel runs publish (link-bound) -> fence + flag -> wait -> combine in series
// (T = 256, Kimi, H200: 12.8 + ~3 + ~4.8 us). Here every 16-byte payload vector is its own arrival signal,
// so a vector is combined as soon as it lands - the combine runs under the transfer - with no fence, no
// flag round trip and no flag bytes on the wire (LL: 1/2 of the bytes, LL128: 1/16).
//
// Rest state and arrival. The payload region of every (slot, source) holds the sentinel 0xFFFF in every
// 16-bit element while no call uses it. A producer never stores 0xFFFF: it rewrites each 0xFFFF element
// (a NaN in bf16 and fp16) to 0x7FC0 (also a NaN in both; a NaN input with nonzero weight gives a NaN output
// either way). The consumer reads a vector as four 32-bit words (ld.volatile.v4.u32: each 32-bit element is
// single-copy atomic in the PTX model; nothing wider is assumed) and takes it once no 16-bit half is
// 0xFFFF: every word is then this call's (an old word would be all sentinel). After combining, the
// consumer stores the sentinel back (weak 16-byte store; only it touches the vector until its next use).
// Every vector of every source is waited for, also when that source's weight is 0 (its bytes are selected
// away, never multiplied, as in every kernel here), so that no late store can land after the reset.
// LSEs travel as two 64-bit words {lse bits, flag half} (one 16-byte access; each u64 single-copy atomic) that
// carry the two halves of the plain kernel's 64-bit flag epoch * 2^20 + T: a word can be older than the slot's
// previous use (rows past a small call's T keep an old call's words), so a 32-bit flag would repeat after 2^12
// calls; the 64-bit one never does, and a peer that called with another T never matches (it times out instead of
// combining stale rows). The reader takes the LSE once both halves match and both words hold the same LSE bits:
// if one word were stale with a coinciding half, either its LSE equals the new one (then the value is right) or
// the words differ and the reader polls on until the new words land.
//
// The same rules in Python, checked on the host against every word a consumer can read (each LSE word the row's
// last earlier write or this call's): peerdcp/output/sentinel.py, tests/test_sentinel_protocol.py.
//
// Why two slots suffice: A writes slot n%2 in call n after its call n-1 completed; call n-1 waited for
// every vector and LSE of B's call n-1, which B published after its call n-2 - which consumed and reset
// slot n%2 - completed (stream order; with PDL, griddepcontrol.wait precedes every access). The resets are
// plain stores performed before B's call n-1 started, A's call-n stores are issued after A saw data B sent
// in call n-1: the same causality the LL protocol relies on for its slots. The region is used only by
// this kernel, so LL, LL128 and plain calls interleave freely with it.
//
// Roles. Combiners take vectors in the order publishers store them (token-major slabs of kBlock vectors), so
// the combine follows the transfer. sn_pub == 0 (or >= G): every CTA publishes its blocks, then combines its
// slabs. 0 < sn_pub < G: CTAs [0, sn_pub) publish, the others combine (see the kernel). All CTAs are
// co-resident (G <= occupancy, host side), so a combiner's wait always ends once its peer's publishers ran; the
// wait is bounded regardless. Every CTA runs in every call (no tight grid): an LSE word's reader is another CTA
// than its writer, so all epochs must agree.
//
// Layout at sn_off: payload [2 slots][W src][max_tokens][H*D/8] uint4 (sentinel at rest), then at
// sn_lse_off LSE words [2][W][max_tokens][H][2] u64.
constexpr uint32_t kSentinelPair = 0xffffffffu;  // two 16-bit sentinels
// slabs per combine round of a thread (every load of a round is issued before its first poll); the build can
// override it for tuning sweeps only: PEERDCP_NVCC_EXTRA="-DPEERDCP_OUTPUT_SN_COMB_UNROLL=4"
#ifndef PEERDCP_OUTPUT_SN_COMB_UNROLL
#define PEERDCP_OUTPUT_SN_COMB_UNROLL 2
#endif
constexpr int kSnCombUnroll = PEERDCP_OUTPUT_SN_COMB_UNROLL;

__device__ __forceinline__ bool has_sentinel(const uint4& v) {
  return (__vcmpeq2(v.x, kSentinelPair) | __vcmpeq2(v.y, kSentinelPair) | __vcmpeq2(v.z, kSentinelPair) |
          __vcmpeq2(v.w, kSentinelPair)) != 0u;
}

// 0xFFFF -> 0x7FC0 in each half (0xFFFF ^ 0x803F); every other value unchanged.
__device__ __forceinline__ uint32_t off_sentinel(uint32_t w) { return w ^ (__vcmpeq2(w, kSentinelPair) & 0x803f803fu); }

// Work geometry of one call of the sentinel kernel, the same in every CTA.
struct SnGeo {
  int W, H, rank, T, VH, HV, N, nslab, nd, nb, slot;
  int64_t WHV, my_row0;
  uint32_t flo, fhi;  // this call's 64-bit LSE flag, low and high halves
};

// One publishing round of a thread: blocks b0 + k*step (k < U); block b = (slab b / nd, destination index b % nd),
// slab s = vectors [s*kBlock, (s+1)*kBlock) of the call's [T, H*D/8] slice. Every load of a round is issued before
// its first store. The loads do not depend on the epoch, so a CTA issues its first round before it has the epoch.
template <int U>
struct SnPubRound {
  uint4 v[U];
  int d[U], vec[U];  // d < 0: nothing to store
};

// The index divisions of this kernel stay runtime divisions on purpose: through FastDiv (as in the LL kernel and
// the shared helpers, output/params.cuh) the kernel measured the same at T = 16 but 15-20 % slower at T >= 64,
// where the publishers are split from the combiners (Kimi T = 128 11.2 vs 9.6 us, T = 256 19.3 vs 16.3; A/B in
// separate processes, the record in bench/RESULTS.md's History). Not understood; the split's optimum is sharp
// (sn_run) and the change moves the publishers' instruction timing.
template <int U>
__device__ __forceinline__ void sn_pub_load(const OutputKernelParams& p, const SnGeo& g, int b0, int step,
                                            SnPubRound<U>& r) {
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
#pragma unroll
  for (int k = 0; k < U; ++k) {
    const int b = b0 + k * step;
    r.d[k] = -1;
    if (b < g.nb) {
      const int s = b / g.nd, dj = b - s * g.nd;
      r.vec[k] = s * kBlock + threadIdx.x;
      if (r.vec[k] < g.N) {
        const int t = r.vec[k] / g.HV;
        r.d[k] = dj + (dj >= g.rank);
        r.v[k] = __ldg(src + t * g.WHV + int64_t(r.d[k]) * g.HV + (r.vec[k] - t * g.HV));
      }
    }
  }
}

template <int U>
__device__ __forceinline__ void sn_pub_store(const OutputKernelParams& p, const SnGeo& g, const SnPubRound<U>& r) {
#pragma unroll
  for (int k = 0; k < U; ++k) {
    if (r.d[k] >= 0) {
      const uint4 w = make_uint4(off_sentinel(r.v[k].x), off_sentinel(r.v[k].y), off_sentinel(r.v[k].z),
                                 off_sentinel(r.v[k].w));
      reinterpret_cast<uint4*>(p.peer_base[r.d[k]] + p.sn_off)[g.my_row0 * g.HV + r.vec[k]] = w;  // weak store
    }
  }
}

// Combine slabs b0 + k*step (k < kSnCombUnroll): every load of the round is issued before the first poll; each
// source's vector is waited for (bounded), combined, and set back to the sentinel. `dead`: sources this thread
// gave up on (one timeout per source, not one per vector). The per-source state is held for the W - 1 remote
// sources only (remote j is source j + (j >= rank)): registers indexed by source would carry a dead entry for
// the own rank, which at W = 2 doubles the state each load in flight holds.
template <typename scalar_t, int WMAX>
__device__ __forceinline__ void sn_combine(const OutputKernelParams& p, const SnGeo& g, int b0, int step, int64_t e,
                                           int& dead) {
  constexpr int RMAX = WMAX - 1;
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  uint4* in_pay = reinterpret_cast<uint4*>(p.peer_base[g.rank] + p.sn_off);
  const uint64_t* in_lse = reinterpret_cast<const uint64_t*>(p.peer_base[g.rank] + p.sn_lse_off);
  const int W = g.W, H = g.H, rank = g.rank, HV = g.HV, VH = g.VH;
  int t[kSnCombUnroll], o[kSnCombUnroll], h[kSnCombUnroll];
  bool valid[kSnCombUnroll];
  float own_l[kSnCombUnroll];
  uint4 own_v[kSnCombUnroll];
  uint4 x[kSnCombUnroll][RMAX];
  uint64_t c[kSnCombUnroll][RMAX], c2[kSnCombUnroll][RMAX];  // the two LSE words
#pragma unroll
  for (int k = 0; k < kSnCombUnroll; ++k) {
    const int vec = (b0 + k * step) * kBlock + threadIdx.x;
    valid[k] = vec < g.N;
    t[k] = o[k] = h[k] = 0;
    if (!valid[k]) continue;
    t[k] = vec / HV;
    o[k] = vec - t[k] * HV;
    h[k] = o[k] / VH;
    own_l[k] = __ldg(p.partial_lse + int64_t(t[k]) * W * H + rank * H + h[k]);
    own_v[k] = __ldg(src + t[k] * g.WHV + int64_t(rank) * HV + o[k]);
#pragma unroll
    for (int j = 0; j < RMAX; ++j) {
      if (j < W - 1) {
        const int64_t row = int64_t(g.slot * W + j + (j >= rank)) * p.max_tokens + t[k];
        x[k][j] = peerdcp::ld_volatile_v4(in_pay + row * HV + o[k]);
        peerdcp::ld_volatile_v2u64(in_lse + (row * H + h[k]) * 2, c[k][j], c2[k][j]);
      }
    }
  }
#pragma unroll
  for (int k = 0; k < kSnCombUnroll; ++k) {
    if (!valid[k]) continue;
    float lr[RMAX];
#pragma unroll
    for (int j = 0; j < RMAX; ++j) {
      if (j < W - 1) {
        const int s = j + (j >= rank);
        const int64_t row = int64_t(g.slot * W + s) * p.max_tokens + t[k];
        const uint64_t* lw = in_lse + (row * H + h[k]) * 2;
        auto lse_here = [&]() {
          return uint32_t(c[k][j] >> 32) == g.flo && uint32_t(c2[k][j] >> 32) == g.fhi &&
                 uint32_t(c[k][j]) == uint32_t(c2[k][j]);
        };
        auto here = [&]() { return lse_here() && !has_sentinel(x[k][j]); };
        if (!here() && !((dead >> s) & 1)) {
          peerdcp::spin_until(p.timeout_ns, here, [&] {
            if (!lse_here()) peerdcp::ld_volatile_v2u64(lw, c[k][j], c2[k][j]);
            if (has_sentinel(x[k][j])) x[k][j] = peerdcp::ld_volatile_v4(in_pay + row * HV + o[k]);
          });
          if (!here()) {  // timed out: this source counts as empty; the host raises at the next call
            dead |= 1 << s;
            peerdcp::report_timeout(p.err, rank, s, p.mech, call_flag(e, g.T));
          }
        }
        const bool ok = here();
        lr[j] = ok ? __uint_as_float(uint32_t(c[k][j])) : -INFINITY;
        if (ok) in_pay[row * HV + o[k]] = make_uint4(kSentinelPair, kSentinelPair, kSentinelPair, kSentinelPair);
      }
    }
    // back to source order (selects between two fixed registers; the combine's summation order is the other
    // kernels')
    float l[WMAX];
    uint4 xs[WMAX];
#pragma unroll
    for (int s = 0; s < WMAX; ++s) {
      const int lo = s > 0 ? s - 1 : 0, hi = s < RMAX ? s : RMAX - 1;
      l[s] = s > rank ? lr[lo] : lr[hi];
      xs[s] = s > rank ? x[k][lo] : x[k][hi];
    }
    combine_store<scalar_t, WMAX>(p, own_l[k], own_v[k], l, xs, t[k], h[k], o[k] - h[k] * VH);
  }
}

// One call of the sentinel kernel with U 16-byte loads in flight per publishing thread (the host picks U per call,
// OutputDirectParams::sn_loads).
template <typename scalar_t, int WMAX, int U>
__device__ __forceinline__ void sn_run(const OutputKernelParams& p, int64_t* s_epoch, int* s_pub) {
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const int G = p.G;
  SnGeo g;
  g.W = p.W, g.H = p.H, g.rank = p.rank, g.T = p.T, g.VH = p.D >> 3;
  g.HV = g.H * g.VH;
  g.WHV = int64_t(g.W) * g.HV;
  g.N = g.T * g.HV;  // < 2^31: host check
  g.nslab = (g.N + kBlock - 1) / kBlock;
  g.nd = g.W - 1;
  g.nb = g.nslab * g.nd;
  // Roles (from the host's publisher count, not from the epoch): sn_pub == 0 (or >= G): every CTA publishes its
  // blocks (round r of all CTAs = blocks [r*G*U, (r+1)*G*U): the slabs leave in order), then combines its slabs.
  // Else CTAs [0, P) publish and CTAs [P, G) combine, each group in the order the blocks leave. A few CTAs
  // saturate the link, and the combiners' loads do not queue behind their own CTA's remote stores (which back up
  // while the link is busy), so the combine runs under the transfer. Measured (H200 x 2, Kimi, T = 256, 4 loads in
  // flight per publisher thread): P = 32 of 264 CTAs 18.1 us; P = 24 / 40 / 48 / 64 / 132: 22.7 / 20.2 / 21.6 /
  // 22.9 / 29.2 us; every CTA both: 22.7 us. The host picks P and U per call (OutputPolicy.cuda_sentinel_split); the
  // optimum is sharp and where the hardware places the CTAs is not controlled (bench/RESULTS.md, Output/LSE).
  const bool split = p.sn_pub > 0 && p.sn_pub < G;
  const int P = split ? p.sn_pub : G, C = split ? G - P : G;
  const bool publisher = !split || prog < P, combiner = !split || prog >= P;
  const int ci = split ? prog - P : prog;
  // LSE words: stored by the combiners (every CTA when all do both): they have nothing else to do until data
  // lands, and the publishers start on the payload at once. Item i = (destination index, token, head).
  const int n_lse = g.nd * g.T * g.H;
  int li = combiner ? ci * kBlock + tid : n_lse;
  auto lse_load = [&](int i, int& d, int& t, int& h) {
    const int dj = i / (g.T * g.H);
    const int r = i - dj * g.T * g.H;
    t = r / g.H, h = r - t * g.H;
    d = dj + (dj >= g.rank);
    return __ldg(p.partial_lse + int64_t(t) * g.W * g.H + d * g.H + h);
  };
  // The first loads go out before the epoch is known (thread 0 fetches it meanwhile): neither depends on it.
  int ld = 0, lt = 0, lh = 0;
  float lv = li < n_lse ? lse_load(li, ld, lt, lh) : 0.f;
  SnPubRound<U> r;
  if (publisher) sn_pub_load<U>(p, g, prog, P, r);
  advance_epoch(p, prog, s_epoch);
  if (tid == 0) *s_pub = publisher;
  __syncthreads();
  const int64_t e = *s_epoch;
  g.slot = static_cast<int>(e & 1);
  g.my_row0 = int64_t(g.slot * g.W + g.rank) * p.max_tokens;
  const uint64_t fv = static_cast<uint64_t>(call_flag(e, p.T));
  g.flo = static_cast<uint32_t>(fv);
  g.fhi = static_cast<uint32_t>(fv >> 32);
  // diagnosis (scripts/diag/sentinel_timeline.py): [start, publish done, combine done, SM] per CTA, in ns
  auto stamp = [&](int k) {
    if (p.dbg == nullptr) return;
    __syncthreads();
    if (tid == 0) {
      uint32_t sm;
      asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
      p.dbg[prog * 4 + k] = static_cast<int64_t>(peerdcp::global_timer_ns());
      p.dbg[prog * 4 + 3] = sm | (*s_pub << 16);
    }
  };
  stamp(0);
  while (li < n_lse) {
    uint64_t* dl = reinterpret_cast<uint64_t*>(p.peer_base[ld] + p.sn_lse_off) + ((g.my_row0 + lt) * g.H + lh) * 2;
    peerdcp::st_volatile_v2u64(dl, (uint64_t(g.flo) << 32) | __float_as_uint(lv),
                               (uint64_t(g.fhi) << 32) | __float_as_uint(lv));
    li += C * kBlock;
    if (li < n_lse) lv = lse_load(li, ld, lt, lh);
  }
  if (publisher) {
    for (int b0 = prog;;) {
      sn_pub_store<U>(p, g, r);
      b0 += P * U;
      if (b0 >= g.nb) break;
      sn_pub_load<U>(p, g, b0, P, r);
    }
    stamp(1);
  }
  if (combiner) {
    int dead = 0;
    for (int b0 = ci; b0 < g.nslab; b0 += C * kSnCombUnroll) sn_combine<scalar_t, WMAX>(p, g, b0, C, e, dead);
    stamp(2);
  }
}

template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock, 2) output_direct_sentinel_kernel(const __grid_constant__ OutputKernelParams p) {
  pdl_enter<kVar>();
  __shared__ int64_t s_epoch;
  __shared__ int s_pub;
  if (p.sn_loads == 1) {
    sn_run<scalar_t, WMAX, 1>(p, &s_epoch, &s_pub);
  } else {
    sn_run<scalar_t, WMAX, 2>(p, &s_epoch, &s_pub);
  }
}

}  // namespace
