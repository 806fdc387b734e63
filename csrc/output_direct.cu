// peerdcp Output/LSE exchange: the fused producer-direct kernel (CUDA fast path).
//
// One launch does publish -> release signal -> bounded acquire wait -> combine, on a grid of G CTAs
// that does not depend on T. It implements exactly the protocol and inbox layout of the Triton twin
// (peerdcp/output/kernels.py, `direct_kernel`; layout: `InboxLayout`):
//
//   inbox of rank r (bytes):  flags   int64 [2 slots][G][W]                at 0
//                             lse     fp32  [2][W src][max_tokens][H]      at lse_off
//                             payload dtype [2][W src][max_tokens][H][D]   at payload_off
//
// * Work unit u = t * NC + c (token t, heads [c*HU, c*HU+HU) of a destination's slice); CTA p owns
//   units p, p+G, p+2G, ... On every rank the same T and G give the same partition, so CTA p of rank A
//   publishes exactly what CTA p of rank B combines and waits only for flags of its peers' CTA p.
//   G <= co-resident CTAs (host side) keeps that deadlock-free; the bounded wait catches the rest.
// * epochs[p] is touched only by CTA p; every CTA runs in every call, so all counters equal the call
//   count. slot = epoch & 1; flag value = epoch * 2^20 + T (a peer with another T never matches).
// * Two slots suffice: rank A writes slot n%2 in call n only after its call n-1 completed (stream
//   order), and call n-1 waited for B's call-(n-1) flags, which B raised after its call n-2 - the last
//   reader of slot n%2 - completed (stream order on B).
// * A rank never publishes to itself: the combine reads its own slice from the input.
// * Combine: sanitize NaN/+inf -> -inf; m = max (0 if -inf); w = b^(l - m); out = sum(w*o) / S. The
//   inbox payload is loaded speculatively (in the same round trip as the LSEs), but a source with
//   w == 0 is dropped by a select, never multiplied: its stale / NaN bytes cannot reach the result.
//   All sources empty -> out 0, lse -inf.
//
// For T <= ll_max_tokens the host's launch picks the LL twin (output_direct_ll_kernel, below): flags
// carried inside the payload words, no fence, no flag round trip.
//
// Opt-in variants (`opts`, default 0 = the kernel above; selected per reducer, agreed by every rank):
//   kOptTightGrid  launch min(G, T*NC) CTAs instead of G. The partition is unchanged (unit u -> CTA u % G,
//                  p.G stays the modulus), so exactly the CTAs that own a unit run; the idle ones are not
//                  launched and their epochs do not advance. Why two slots still suffice: every inbox cell
//                  (flag [slot][p][src], LSE / payload row of a unit) has one writer, CTA p of its source,
//                  and one reader, CTA p of its destination, with p = u % G fixed for the cell. CTA p runs in
//                  a call iff T*NC > p, and T is the same on every rank, so epochs[p] counts the same calls on
//                  every rank (flag values still agree), and the plain argument above holds per CTA over the
//                  calls in which CTA p runs: A's k-th run of CTA p writes slot k%2 after A's call holding
//                  its (k-1)-th run completed; that run waited for B's CTA p flag of run k-1, raised in a B
//                  call that started after B's call holding run k-2 - the last reader of slot k%2 - completed.
//   kOptEarlyLoad  issue the first round of input loads (payload vectors and LSEs) before the epoch read and
//                  its barrier, so the epoch, payload and LSE load latencies overlap instead of adding up.
//                  Inputs only; nothing is stored before the epoch is known, so the protocol is unchanged.
//   kOptPdl        programmatic dependent launch: the launch carries
//                  cudaLaunchAttributeProgrammaticStreamSerialization; every CTA first executes
//                  griddepcontrol.wait (returns once the preceding grid has completed and its memory is
//                  visible: the same guarantee as stream order, and it precedes every load and store here,
//                  so the slot argument is unchanged), then griddepcontrol.launch_dependents, so the next
//                  PDL launch is staged while this one runs. Deadlock freedom: dependents are launched only
//                  after every CTA of this grid issued the trigger, i.e. all of them are already resident.
//   kOptLL128      calls with ll_max_tokens < T <= ll128_max_tokens run output_direct_ll128_kernel (below; flags
//                  inside 128-byte lines, NCCL's LL128) instead of the plain kernel. Not with kOptTightGrid (the
//                  LL128 reader of an LSE word may be another CTA than its writer, so every CTA must run in every
//                  call). The host sets it per call: for T in the band (max(ll_max, ll128_min), ll128_max]
//                  (default (20, 48], measured faster there) or, with the "ll128" option, every T > ll_max.
//                  The C side only checks T <= ll128_max_tokens. LL, LL128 and plain calls interleave freely:
//                  each has its own region, all three advance every CTA's epoch, and the two-slot argument
//                  holds per region.
//   kOptChunked    calls with T > ll_max_tokens run output_direct_chunked_kernel (below; the plain protocol
//                  released per chunk of units by a signalling warp). Not with kOptLL128 or kOptEarlyLoad.
//   kOptSplit      with kOptChunked only: separate publishing and combining warps in that kernel.
//
// Stage breakdown (`stages`, benchmark only; 0 in every public path; outputs of a broken variant are
// garbage): bits remove one stage and whatever waits for it, identically on every rank:
//   kSkipPayload (payload stores; LL: and the poll on payload words), kSkipLse (LSE stores; LL: and their
//   poll), kSkipSync (flag store and wait; LL: no poll), kSkipCombine (combine loads and output stores),
//   kStageEmpty (the CTAs return at once: launch cost of the same grid; epochs untouched),
//   kStageInstrumented (nothing skipped, but the instrumented build: its cost vs the default build).
// Any nonzero `stages` runs a separate instantiation; the default build has no stage checks at all.
// Every wait still has its matching publish, so no mask can time out when all ranks use the same one.
//
// C ABI: peerdcp_output_direct(const OutputDirectParams*, cudaStream_t, int device) -> cudaError_t (as int).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace {

constexpr int kMaxWorld = 8;
constexpr int kBlock = 256;     // threads per CTA
// (the two unroll depths can be overridden at build time for tuning sweeps only:
//  PEERDCP_NVCC_EXTRA="-DPEERDCP_OUTPUT_PUB_UNROLL=8 ..." - see scripts/diag/output_tune.py)
#ifndef PEERDCP_OUTPUT_PUB_UNROLL
#define PEERDCP_OUTPUT_PUB_UNROLL 4
#endif
#ifndef PEERDCP_OUTPUT_COMB_UNROLL
#define PEERDCP_OUTPUT_COMB_UNROLL 2
#endif
constexpr int kPubUnroll = PEERDCP_OUTPUT_PUB_UNROLL;    // 16-byte loads in flight per thread while publishing
constexpr int kCombUnroll = PEERDCP_OUTPUT_COMB_UNROLL;  // output vectors per thread per combine round
constexpr int64_t kTokenSpace = int64_t(1) << 20;

// `stages` bits (benchmark-only breakdown; mirrors peerdcp/output/ops.py STAGE_*)
constexpr int kSkipPayload = 1, kSkipLse = 2, kSkipSync = 4, kSkipCombine = 8, kStageEmpty = 16,
              kStageInstrumented = 32;
constexpr int kStagesAll = kSkipPayload | kSkipLse | kSkipSync | kSkipCombine | kStageEmpty | kStageInstrumented;
// `opts` bits (opt-in variants; mirrors peerdcp/output/ops.py OPT_*)
constexpr int kOptTightGrid = 1, kOptEarlyLoad = 2, kOptPdl = 4, kOptLL128 = 8, kOptChunked = 16, kOptSplit = 32;
constexpr int kOptsAll = kOptTightGrid | kOptEarlyLoad | kOptPdl | kOptLL128 | kOptChunked | kOptSplit;
// compile-time kernel variants (template argument kVar): which of the above the instantiation contains
constexpr int kVarStages = 1, kVarEarly = 2, kVarPdl = 4, kVarSplit = 8;

// Mirrors peerdcp/output/ops.py::OutputDirectParams (ctypes). Keep the order and types in sync;
// peerdcp_output_direct_params_size() lets Python check the size.
struct OutputDirectParams {
  const void* partial_out;  // [T, W*H, D] bf16/fp16, contiguous, 16-byte aligned
  const float* partial_lse; // [T, W*H] fp32, contiguous
  void* out;                // [T, H, D], contiguous, 16-byte aligned
  float* out_lse;           // [T, H] fp32 or nullptr
  int64_t* epochs;          // [G] device memory, this rank only
  int64_t* err;             // int64[8] pinned host memory (device-mapped)
  char* peer_base[kMaxWorld];  // inbox base of every rank, as mapped in this process
  int64_t lse_off;
  int64_t payload_off;
  int64_t timeout_ns;
  int64_t ll_off;           // LL region (see output_direct_ll_kernel)
  int64_t ll128_off;        // LL128 region (see output_direct_ll128_kernel; used with kOptLL128)
  int32_t T, rank, W, H, D, max_tokens, G, heads_per_unit;
  int32_t base2, mech, dtype;  // dtype: 0 = bf16, 1 = fp16
  int32_t ll_max_tokens;    // calls with T <= this use the LL kernel (0: never)
  int32_t stages;           // stage-breakdown mask (benchmark only; 0 = the full kernel)
  int32_t opts;             // opt-in variants (kOpt*; 0 = default)
  int32_t ll128_max_tokens; // with kOptLL128: calls with ll_max_tokens < T <= this use the LL128 kernel, larger
                            // T the plain one; also the LL128 region's rows per (slot, source)
};

// griddepcontrol (PTX ISA 7.8, sm_90): programmatic dependent launch.
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// With PDL (kVarPdl), the first thing every CTA does: griddepcontrol.wait returns once the preceding grid
// (the previous call) has completed and its memory is visible, before any load or store here; then allow
// the next PDL launch to be staged.
template <int kVar>
__device__ __forceinline__ void pdl_enter() {
  if constexpr ((kVar & kVarPdl) != 0) {
    griddep_wait();
    griddep_launch_dependents();
  }
}

// This call's epoch of CTA prog: thread 0 bumps epochs[prog] (only CTA prog ever touches it, so no atomic)
// and leaves the value in shared memory; the caller's __syncthreads hands it to the whole CTA.
__device__ __forceinline__ void advance_epoch(const OutputDirectParams& p, int prog, int64_t* s_epoch) {
  if (threadIdx.x == 0) {
    const int64_t e = p.epochs[prog] + 1;
    p.epochs[prog] = e;
    *s_epoch = e;
  }
}

// Work geometry of one call, the same in every CTA (nothing here depends on the epoch).
struct Geo {
  int W, H, rank, G, HU, NC, n_units, VH, UV, my_units, nd, per_unit, pub_items, lse_per_unit, lse_items;
  int64_t HV, WHV;
};

__device__ __forceinline__ Geo make_geo(const OutputDirectParams& p, int prog) {
  Geo g;
  g.W = p.W, g.H = p.H, g.rank = p.rank, g.G = p.G;
  g.HU = p.heads_per_unit;
  g.NC = (g.H + g.HU - 1) / g.HU;
  g.n_units = p.T * g.NC;
  g.VH = p.D >> 3;                    // 16-byte vectors per head
  g.UV = g.HU * g.VH;                 // vectors per unit and destination
  g.HV = int64_t(g.H) * g.VH;         // vectors per (token, source) slice
  g.WHV = int64_t(g.W) * g.HV;        // vectors per token of partial_out
  g.my_units = prog < g.n_units ? (g.n_units - 1 - prog) / g.G + 1 : 0;
  g.nd = g.W - 1;
  g.per_unit = g.nd * g.UV;
  g.pub_items = g.my_units * g.per_unit;
  g.lse_per_unit = g.nd * g.HU;
  g.lse_items = g.my_units * g.lse_per_unit;
  return g;
}

// One publish round of a thread: up to kPubUnroll (unit, destination != rank, vector) items, loaded from
// the input; d < 0 marks no item. The destination address needs the slot, so it is formed at the store.
struct PubRound {
  uint4 v[kPubUnroll];
  int d[kPubUnroll], t[kPubUnroll];
  int64_t off[kPubUnroll];  // vector index within the (token, source) slice
};

// (`stride`: threads sharing the items; `end`: one past the last item, -1 = all of the CTA's items)
__device__ __forceinline__ void pub_load(const OutputDirectParams& p, const Geo& g, int prog, int i0, PubRound& r,
                                         int stride = kBlock, int end = -1) {
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  if (end < 0) end = g.pub_items;
#pragma unroll
  for (int k = 0; k < kPubUnroll; ++k) {
    r.d[k] = -1;
    const int i = i0 + k * stride;
    if (i < end) {
      const int ku = i / g.per_unit;
      const int rr = i - ku * g.per_unit;
      const int dj = rr / g.UV;
      const int vi = rr - dj * g.UV;
      const int u = prog + ku * g.G;
      const int t = u / g.NC;
      const int h0 = (u - t * g.NC) * g.HU;
      if (vi < min(g.HU, g.H - h0) * g.VH) {
        const int d = dj + (dj >= g.rank);
        const int64_t off = int64_t(h0) * g.VH + vi;
        r.v[k] = __ldg(src + t * g.WHV + d * g.HV + off);
        r.d[k] = d;
        r.t[k] = t;
        r.off[k] = off;
      }
    }
  }
}

// One LSE item of a thread ((unit, destination, head) item i); d < 0 marks no item.
struct LseItem {
  float v;
  int d, t, h;
};

__device__ __forceinline__ void lse_load(const OutputDirectParams& p, const Geo& g, int prog, int i, LseItem& it) {
  it.d = -1;
  if (i < g.lse_items) {
    const int ku = i / g.lse_per_unit;
    const int rr = i - ku * g.lse_per_unit;
    const int dj = rr / g.HU;
    const int u = prog + ku * g.G;
    const int t = u / g.NC;
    const int h = (u - t * g.NC) * g.HU + (rr - dj * g.HU);
    if (h < g.H) {
      const int d = dj + (dj >= g.rank);
      it.v = p.partial_lse[int64_t(t) * g.W * g.H + d * g.H + h];
      it.d = d;
      it.t = t;
      it.h = h;
    }
  }
}

__device__ __forceinline__ float sanitize(float l) { return (l < INFINITY) ? l : -INFINITY; }  // NaN, +inf -> -inf

// The combine rule for one output vector (8 elements) from W sources: own source `rank` in (own_l, own_v),
// the others in (l[s], x[s]). A source with weight 0 is dropped by a select (its payload is never used).
template <typename scalar_t, int WMAX>
__device__ __forceinline__ void combine_store(const OutputDirectParams& p, float own_l, uint4 own_v,
                                              const float (&l)[WMAX], const uint4 (&x)[WMAX], int t, int h, int j) {
  using P8 = peerdcp::Pack8<scalar_t>;
  const int W = p.W, rank = p.rank, H = p.H, VH = p.D >> 3;
  float ls[WMAX];
  float m = -INFINITY;
#pragma unroll
  for (int s = 0; s < WMAX; ++s) {
    if (s < W) {
      ls[s] = sanitize(s == rank ? own_l : l[s]);
      m = fmaxf(m, ls[s]);
    }
  }
  if (m == -INFINITY) m = 0.f;
  float acc[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] = 0.f;
  float S = 0.f;
#pragma unroll
  for (int s = 0; s < WMAX; ++s) {
    if (s < W) {
      const float w = p.base2 ? exp2f(ls[s] - m) : __expf(ls[s] - m);
      S += w;
      if (w > 0.f) {  // select, never 0 * payload
        float f[8];
        P8::to_float(s == rank ? own_v : x[s], f);
#pragma unroll
        for (int q = 0; q < 8; ++q) acc[q] = fmaf(w, f[q], acc[q]);
      }
    }
  }
  const float inv = S > 0.f ? 1.f / S : 0.f;
#pragma unroll
  for (int q = 0; q < 8; ++q) acc[q] *= inv;
  reinterpret_cast<uint4*>(p.out)[int64_t(t) * H * VH + int64_t(h) * VH + j] = P8::from_float(acc);
  if (p.out_lse != nullptr && j == 0) {
    p.out_lse[int64_t(t) * H + h] = S > 0.f ? m + (p.base2 ? log2f(S) : logf(S)) : -INFINITY;
  }
}

// Output vector item i of CTA prog -> (t, h, j); false past the end or in a partial head chunk's padding.
__device__ __forceinline__ bool decode_item(const OutputDirectParams& p, int prog, int NC, int UV, int items, int i,
                                            int& t, int& h, int& j) {
  if (i >= items) return false;
  const int VH = p.D >> 3, HU = p.heads_per_unit;
  const int ku = i / UV;
  const int vi = i - ku * UV;
  const int u = prog + ku * p.G;
  t = u / NC;
  const int h0 = (u - t * NC) * HU;
  if (vi >= min(HU, p.H - h0) * VH) return false;
  h = h0 + vi / VH;
  j = vi - (vi / VH) * VH;
  return true;
}

template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock) output_direct_kernel(const __grid_constant__ OutputDirectParams p) {
  constexpr bool kEarly = (kVar & kVarEarly) != 0;
  const int stages = (kVar & kVarStages) ? p.stages : 0;  // the default build has no stage checks
  if ((kVar & kVarStages) && (stages & kStageEmpty)) return;
  pdl_enter<kVar>();
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const Geo g = make_geo(p, prog);
  PubRound pr;
  LseItem li;
  if constexpr (kEarly) {  // first-round input loads in flight while the epoch is read
    if (prog < g.n_units) {
      pub_load(p, g, prog, tid, pr);
      lse_load(p, g, prog, tid, li);
    }
  }
  __shared__ int64_t s_epoch;
  __shared__ int s_ok;
  advance_epoch(p, prog, &s_epoch);
  if (tid == 0) s_ok = 1 << p.rank;
  __syncthreads();
  const int64_t e = s_epoch;
  const int slot = static_cast<int>(e & 1);
  const int64_t fv = e * kTokenSpace + p.T;
  const int W = g.W, H = g.H, rank = g.rank;
  const int NC = g.NC, UV = g.UV, VH = g.VH;
  const int64_t HV = g.HV, WHV = g.WHV;
  if (prog >= g.n_units) return;  // idle CTA: only the epoch advances (its peers' CTA p is idle too)

  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  const int64_t my_row0 = int64_t(slot * W + rank) * p.max_tokens;  // my rows in every destination inbox

  // ---- 1. publish payload: (unit, destination != rank, vector) items, kPubUnroll loads in flight
  if (!(stages & kSkipPayload)) {
    for (int i0 = tid; i0 < g.pub_items; i0 += kBlock * kPubUnroll) {
      if (!kEarly || i0 != tid) pub_load(p, g, prog, i0, pr);
#pragma unroll
      for (int k = 0; k < kPubUnroll; ++k) {
        if (pr.d[k] >= 0) {
          reinterpret_cast<uint4*>(p.peer_base[pr.d[k]] + p.payload_off)[(my_row0 + pr.t[k]) * HV + pr.off[k]] =
              pr.v[k];
        }
      }
    }
  }
  // ---- 1b. publish LSE: (unit, destination, head) items
  if (!(stages & kSkipLse)) {
    for (int i = tid; i < g.lse_items; i += kBlock) {
      if (!kEarly || i != tid) lse_load(p, g, prog, i, li);
      if (li.d >= 0) reinterpret_cast<float*>(p.peer_base[li.d] + p.lse_off)[(my_row0 + li.t) * H + li.h] = li.v;
    }
  }

  // ---- 2. release-signal every destination: the barrier orders all of the CTA's stores before it
  __syncthreads();
  const bool sync = !(stages & kSkipSync);
  if (sync && tid < W && tid != rank) {
    int64_t* flag = reinterpret_cast<int64_t*>(p.peer_base[tid]) + (int64_t(slot) * g.G + prog) * W + rank;
    peerdcp::st_release_sys(flag, fv);
  }
  if (stages & kSkipCombine) return;

  // ---- prefetch this thread's own-source data for the first combine round (overlaps the flag latency)
  const int comb_items = g.my_units * UV;
  float own_l[kCombUnroll];
  uint4 own_v[kCombUnroll];
  int item_t[kCombUnroll], item_h[kCombUnroll], item_j[kCombUnroll];
  auto load_own = [&](int i0) {
#pragma unroll
    for (int k = 0; k < kCombUnroll; ++k) {
      if (decode_item(p, prog, NC, UV, comb_items, i0 + k * kBlock, item_t[k], item_h[k], item_j[k])) {
        own_l[k] = __ldg(p.partial_lse + int64_t(item_t[k]) * W * H + rank * H + item_h[k]);
        own_v[k] = __ldg(src + item_t[k] * WHV + rank * HV + int64_t(item_h[k]) * VH + item_j[k]);
      } else {
        item_t[k] = -1;
      }
    }
  };
  load_own(tid);

  // ---- 3. bounded acquire wait for every source's CTA p
  if (tid < W && tid != rank) {
    if (!sync) {
      atomicOr(&s_ok, 1 << tid);  // breakdown without signal+wait: read the inbox as it is
    } else {
      const int64_t* flag =
          reinterpret_cast<const int64_t*>(p.peer_base[rank]) + (int64_t(slot) * g.G + prog) * W + tid;
      if (peerdcp::wait_equal_sys(flag, fv, p.timeout_ns, p.err, rank, tid, p.mech)) atomicOr(&s_ok, 1 << tid);
    }
  }
  __syncthreads();
  const int ok = s_ok;  // a source whose wait timed out counts as empty (the host raises at the next call)

  // ---- 4. combine: all sources' LSEs and payloads in one round trip (payload read speculatively)
  const float* in_lse = reinterpret_cast<const float*>(p.peer_base[rank] + p.lse_off);
  const uint4* in_pay = reinterpret_cast<const uint4*>(p.peer_base[rank] + p.payload_off);
  for (int i0 = tid; i0 < comb_items; i0 += kBlock * kCombUnroll) {
    if (i0 != tid) load_own(i0);
    float l[kCombUnroll][WMAX];
    uint4 x[kCombUnroll][WMAX];
#pragma unroll
    for (int k = 0; k < kCombUnroll; ++k) {
      if (item_t[k] < 0) continue;
#pragma unroll
      for (int s = 0; s < WMAX; ++s) {
        if (s < W && s != rank) {
          const int64_t row = (int64_t(slot * W + s) * p.max_tokens + item_t[k]) * H + item_h[k];
          l[k][s] = ((ok >> s) & 1) ? __ldcg(in_lse + row) : -INFINITY;
          x[k][s] = __ldcg(in_pay + row * VH + item_j[k]);
        }
      }
    }
#pragma unroll
    for (int k = 0; k < kCombUnroll; ++k) {
      if (item_t[k] >= 0) combine_store<scalar_t, WMAX>(p, own_l[k], own_v[k], l[k], x[k], item_t[k], item_h[k], item_j[k]);
    }
  }
}

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
__global__ void __launch_bounds__(kBlock) output_direct_ll_kernel(const __grid_constant__ OutputDirectParams p) {
  constexpr bool kEarly = (kVar & kVarEarly) != 0;
  const int stages = (kVar & kVarStages) ? p.stages : 0;  // the default build has no stage checks
  if ((kVar & kVarStages) && (stages & kStageEmpty)) return;
  pdl_enter<kVar>();
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const Geo g = make_geo(p, prog);
  PubRound pr;
  LseItem li;
  if constexpr (kEarly) {  // first-round input loads in flight while the epoch is read
    if (prog < g.n_units) {
      pub_load(p, g, prog, tid, pr);
      lse_load(p, g, prog, tid, li);
    }
  }
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
        if (!ready && !((dead >> s) & 1)) {
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
            peerdcp::report_timeout(p.err, rank, s, p.mech, e * kTokenSpace + p.T);
          }
        }
        l[s] = ready ? __uint_as_float(c.x) : -INFINITY;
        x[s] = ready ? make_uint4(a.x, a.z, b.x, b.z) : make_uint4(0, 0, 0, 0);
      }
    }
    if (do_combine) combine_store<scalar_t, WMAX>(p, own_l, own_v, l, x, t, h, j);
  }
}

// -------------------------------------------------------------------------------------------- chunked
// Medium and large T (opt-in `kOptChunked`, used for T > ll_max_tokens): the plain protocol (payload and
// LSE stores, then a release flag; PTX memory model only), but released and consumed in chunks of the
// CTA's units, so the combine of early chunks overlaps the transfer of later ones. Stage costs of the plain
// kernel at T = 256 (Kimi, H200) are payload 12.8 us (link-bound), signal+wait ~3 us and combine ~4.8 us,
// all in series; this kernel is the attempt to put the last two under the first.
//
// Roles: warp 0 signals; the other warps publish and combine, either the same warps one after the other
// (default) or, with kOptSplit, warps 1..3 publish while warps 4..7 combine (nothing orders the two groups:
// the combiners start on chunk 0 while later chunks are still being published).
//   publishers: for each chunk c: publish its units' payload and LSEs, bar.arrive(kBarPub + c) (no wait);
//   combiners:  for each chunk c: the first combining warp's lanes wait (bounded acquire) for every peer's
//               chunk-c flag, bar.sync(kBarComb + c) among the combiners, combine chunk c.
//   warp 0:  for each chunk c: bar.sync(kBarPub + c) (every worker's chunk-c stores are ordered before it:
//            barrier arrive -> sync is CTA-scope synchronization), then lane s releases flag value
//            fv * 8 + c into destination s's flag word (one release per destination, after the barrier,
//            as in the plain kernel). Warp 0 never waits for a peer, so chunk c+1's release does not wait
//            for chunk c's arrival.
// Flags: the plain kernel's words ([2 slots][G][W]); within a call the values fv*8 + 0, 1, ... are stored in
// order by one lane to one address (coherence keeps that order), and every value of an older call with
// the same slot is smaller (fv grows with the epoch). A waiter polls until value >= fv*8 + c and then
// requires value / 8 == fv exactly (a peer with another T or epoch is reported, never combined).
// Chunks: ceil(my_units / upc) chunks of upc = ceil(my_units / kMaxChunks) consecutive CTA-local units (the
// same partition on every rank: unit u -> CTA u % G, as the plain kernel). Two slots suffice by the plain
// kernel's argument: every chunk of a call is waited for before the call completes.
constexpr int kWorkers = kBlock - 32;       // publish + combine, one after the other (default)
constexpr int kSplitPub = 96, kSplitComb = kBlock - 32 - kSplitPub;  // kOptSplit: warps 1..3 and 4..7
constexpr int kMaxChunks = 7;               // named barriers: 1..7 publish, 8..14 combine (0 = __syncthreads)
constexpr int kBarPub = 1, kBarComb = 8;

// bar.arrive / bar.sync are warp-aligned: __syncwarp() first reconverges a warp that diverged before them.
// Arrive and sync both order the thread's prior memory accesses before the barrier's completion for every
// participating thread (PTX ISA, barrier{.cta}), which is what the release after the sync relies on.
__device__ __forceinline__ void named_bar_arrive(int id, int count) {
  __syncwarp();
  asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int count) {
  __syncwarp();
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(count) : "memory");
}

// Bounded acquire poll until *flag >= target; true iff it got there in time and *flag / 8 == target / 8.
__device__ __forceinline__ bool wait_chunk(const int64_t* flag, int64_t target, const OutputDirectParams& p, int peer) {
  int64_t v = peerdcp::ld_acquire_sys(flag);
  if (v < target) {
    const uint64_t t0 = peerdcp::global_timer_ns();
    while (v < target) {
      for (int i = 0; i < 64 && v < target; ++i) v = peerdcp::ld_acquire_sys(flag);
      if (v < target && static_cast<int64_t>(peerdcp::global_timer_ns() - t0) > p.timeout_ns) break;
    }
  }
  if (v >= target && (v >> 3) == (target >> 3)) return true;
  peerdcp::report_timeout(p.err, p.rank, peer, p.mech, target >> 3);  // late, or a peer with another T
  return false;
}

template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock) output_direct_chunked_kernel(const __grid_constant__ OutputDirectParams p) {
  pdl_enter<kVar>();
  const int prog = blockIdx.x;
  const int tid = threadIdx.x;
  const Geo g = make_geo(p, prog);
  __shared__ int64_t s_epoch;
  __shared__ int s_ok[kMaxChunks];
  advance_epoch(p, prog, &s_epoch);
  if (tid < kMaxChunks) s_ok[tid] = 1 << p.rank;
  __syncthreads();
  const int64_t e = s_epoch;
  const int slot = static_cast<int>(e & 1);
  const int64_t fv = e * kTokenSpace + p.T;
  const int W = g.W, H = g.H, rank = g.rank;
  const int NC = g.NC, UV = g.UV, VH = g.VH;
  const int64_t HV = g.HV, WHV = g.WHV;
  if (prog >= g.n_units) return;  // idle CTA (all threads): only the epoch advances, as in the plain kernel
  const int upc = (g.my_units + kMaxChunks - 1) / kMaxChunks;  // units per chunk (the last may hold fewer)
  const int nch = (g.my_units + upc - 1) / upc;                 // 1..kMaxChunks chunks, none empty

  constexpr bool kSplit = (kVar & kVarSplit) != 0;
  constexpr int nPub = kSplit ? kSplitPub : kWorkers, nComb = kSplit ? kSplitComb : kWorkers;
  constexpr int comb0 = kSplit ? 32 + kSplitPub : 32;  // first combining thread

  if (tid < 32) {  // ---- warp 0: release each chunk once every publisher published it
    for (int c = 0; c < nch; ++c) {
      named_bar_sync(kBarPub + c, 32 + nPub);
      if (tid < W && tid != rank) {
        int64_t* flag = reinterpret_cast<int64_t*>(p.peer_base[tid]) + (int64_t(slot) * g.G + prog) * W + rank;
        peerdcp::st_release_sys(flag, fv * 8 + c);
      }
    }
    return;
  }
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  const int64_t my_row0 = int64_t(slot * W + rank) * p.max_tokens;

  // ---- publishers: chunk by chunk
  if (tid < 32 + nPub) {
    const int pt = tid - 32;
    for (int c = 0; c < nch; ++c) {
      const int u0 = min(c * upc, g.my_units), u1 = min(u0 + upc, g.my_units);
      const int pub_end = u1 * g.per_unit;
      for (int i0 = u0 * g.per_unit + pt; i0 < pub_end; i0 += nPub * kPubUnroll) {
        PubRound pr;
        pub_load(p, g, prog, i0, pr, nPub, pub_end);
#pragma unroll
        for (int k = 0; k < kPubUnroll; ++k) {
          if (pr.d[k] >= 0) {
            reinterpret_cast<uint4*>(p.peer_base[pr.d[k]] + p.payload_off)[(my_row0 + pr.t[k]) * HV + pr.off[k]] =
                pr.v[k];
          }
        }
      }
      const int lse_end = u1 * g.lse_per_unit;
      for (int i = u0 * g.lse_per_unit + pt; i < lse_end; i += nPub) {
        LseItem li;
        lse_load(p, g, prog, i, li);
        if (li.d >= 0) reinterpret_cast<float*>(p.peer_base[li.d] + p.lse_off)[(my_row0 + li.t) * H + li.h] = li.v;
      }
      named_bar_arrive(kBarPub + c, 32 + nPub);
    }
  }
  if (tid < comb0) return;  // split: the publishers are done

  // ---- combiners: wait for chunk c from every peer, combine it
  const int ct = tid - comb0;
  const float* in_lse = reinterpret_cast<const float*>(p.peer_base[rank] + p.lse_off);
  const uint4* in_pay = reinterpret_cast<const uint4*>(p.peer_base[rank] + p.payload_off);
  const int comb_items = g.my_units * UV;
  int dead = 0;  // peers that already failed a wait (one report per peer, and no second full timeout)
  for (int c = 0; c < nch; ++c) {
    const int u0 = min(c * upc, g.my_units), u1 = min(u0 + upc, g.my_units);
    if (ct < W && ct != rank && !((dead >> ct) & 1)) {
      const int64_t* flag =
          reinterpret_cast<const int64_t*>(p.peer_base[rank]) + (int64_t(slot) * g.G + prog) * W + ct;
      if (wait_chunk(flag, fv * 8 + c, p, ct)) {
        atomicOr(&s_ok[c], 1 << ct);
      } else {
        dead |= 1 << ct;
      }
    }
    named_bar_sync(kBarComb + c, nComb);
    const int ok = s_ok[c];  // a source whose wait failed counts as empty (the host raises at the next call)
    for (int i = u0 * UV + ct; i < u1 * UV; i += nComb) {
      int t, h, j;
      if (!decode_item(p, prog, NC, UV, comb_items, i, t, h, j)) continue;
      const float own_l = __ldg(p.partial_lse + int64_t(t) * W * H + rank * H + h);
      const uint4 own_v = __ldg(src + t * WHV + rank * HV + int64_t(h) * VH + j);
      float l[WMAX];
      uint4 x[WMAX];
#pragma unroll
      for (int s = 0; s < WMAX; ++s) {
        if (s < W && s != rank) {
          const int64_t row = (int64_t(slot * W + s) * p.max_tokens + t) * H + h;
          l[s] = ((ok >> s) & 1) ? __ldcg(in_lse + row) : -INFINITY;
          x[s] = __ldcg(in_pay + row * VH + j);
        }
      }
      combine_store<scalar_t, WMAX>(p, own_l, own_v, l, x, t, h, j);
    }
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
// MEASURED (2 x H200, 2026-11-30, bench.output --quick, Kimi, graph): correct (10,000 graph replays with
// changing inputs, 0 mismatches, vmm and symm; adversarial LSEs; missing peer -> PeerTimeoutError) but not
// faster than the plain kernel where it was meant to help: T = 128 13.4-14.5 us vs 13.3, T = 256 26-27 us
// vs 22.1; about 0.5 us faster at T = 32 in some runs. Tried without a gain: one line per thread per round,
// kCU lines per round (kept), weak instead of volatile line stores (kept; no difference), split producer /
// consumer warps (T = 128 17.4 us, left off), flag-only polling with __nanosleep back-off (slightly worse,
// not kept). Session 5 (same run, with PDL): 6.55 us at T = 32 vs 7.13 for the plain kernel, but 6.38 vs 5.34
// at T = 16, 9.1 vs 9.2 at T = 64, 26.0 vs 21.7 at T = 256; a T scan put the gain at 24 <= T <= 48, so the
// host uses it in the band (20, 48] by default. Not yet measured: a stage breakdown (publish vs the link).
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
// H200 (2026-11-30: T = 128 17.4 vs 13.5 us), so every thread publishes, then combines.
constexpr bool kLL128SplitRoles = false;
constexpr int kProducers = kLL128SplitRoles ? kBlock / 2 : kBlock;  // threads (whole warps) that publish
constexpr int kConsumers = kLL128SplitRoles ? kBlock - kProducers : kBlock;
constexpr int kConsumer0 = kLL128SplitRoles ? kProducers : 0;        // first combining thread

struct Ll128Geo {
  int PW, NL, lines, lo, hi;  // payload words per slice, lines per row, lines of the call, this CTA's [lo, hi)
  int64_t rowW;               // 8-byte words per (slot, src, token) row
};

__device__ __forceinline__ Ll128Geo make_ll128_geo(const OutputDirectParams& p, int prog) {
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
__device__ __forceinline__ uint2 combine_word(const OutputDirectParams& p, float own_l, uint2 own_w,
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
__global__ void __launch_bounds__(kBlock, 2) output_direct_ll128_kernel(const __grid_constant__ OutputDirectParams p) {
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
  const int64_t fv = e * kTokenSpace + p.T;
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
          const uint64_t t0 = peerdcp::global_timer_ns();
          int spins = 0;
          while (c.y != f) {
            c = peerdcp::ld_volatile_v2(lw + h);
            if (c.y != f && ++spins == 64) {
              spins = 0;
              if (static_cast<int64_t>(peerdcp::global_timer_ns() - t0) > p.timeout_ns) break;
            }
          }
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

// Launch one instantiation: with PDL through cudaLaunchKernelEx (capturable: a programmatic graph edge).
template <int kVar>
cudaError_t launch_one(void (*kernel)(const OutputDirectParams), int grid, const OutputDirectParams& p,
                       cudaStream_t stream) {
  if constexpr ((kVar & kVarPdl) == 0) {
    kernel<<<dim3(grid), dim3(kBlock), 0, stream>>>(p);
    return cudaSuccess;
  } else {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(kBlock);
    cfg.dynamicSmemBytes = 0;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
}

template <typename scalar_t, int WMAX, int kVar>
cudaError_t launch_var(const OutputDirectParams& p, cudaStream_t stream) {
  int grid = p.G;
  if (p.opts & kOptTightGrid) {  // only the CTAs that own a unit (see kOptTightGrid above)
    const int64_t n_units = int64_t(p.T) * ((p.H + p.heads_per_unit - 1) / p.heads_per_unit);
    grid = n_units < p.G ? static_cast<int>(n_units) : p.G;
  }
  if (p.T <= p.ll_max_tokens) return launch_one<kVar>(output_direct_ll_kernel<scalar_t, WMAX, kVar>, grid, p, stream);
  if ((p.opts & kOptLL128) && p.T <= p.ll128_max_tokens) {  // every CTA, every call (see the LL128 notes)
    constexpr int kVarLL128 = kVar & kVarPdl;
    return launch_one<kVarLL128>(output_direct_ll128_kernel<scalar_t, WMAX, kVarLL128>, p.G, p, stream);
  }
  if (p.opts & kOptChunked) {  // the plain partition (tight grid allowed); stages / early load do not apply
    constexpr int kVarChunked = kVar & kVarPdl;
    if (p.opts & kOptSplit) {
      return launch_one<kVarChunked>(output_direct_chunked_kernel<scalar_t, WMAX, kVarChunked | kVarSplit>, grid, p,
                                     stream);
    }
    return launch_one<kVarChunked>(output_direct_chunked_kernel<scalar_t, WMAX, kVarChunked>, grid, p, stream);
  }
  return launch_one<kVar>(output_direct_kernel<scalar_t, WMAX, kVar>, grid, p, stream);
}

// The compile-time variant for a call: the stage-instrumented build for any nonzero `stages` (no opt-in
// kernel changes with it), else the early-load / PDL combination of `opts` (0: the default build).
inline int kernel_var(const OutputDirectParams& p) {
  if (p.stages != 0) return kVarStages;
  return ((p.opts & kOptEarlyLoad) ? kVarEarly : 0) | ((p.opts & kOptPdl) ? kVarPdl : 0);
}

template <typename scalar_t, int WMAX>
cudaError_t launch_w(const OutputDirectParams& p, cudaStream_t stream) {
  switch (kernel_var(p)) {
    case 0: return launch_var<scalar_t, WMAX, 0>(p, stream);
    case kVarStages: return launch_var<scalar_t, WMAX, kVarStages>(p, stream);
    case kVarEarly: return launch_var<scalar_t, WMAX, kVarEarly>(p, stream);
    case kVarPdl: return launch_var<scalar_t, WMAX, kVarPdl>(p, stream);
    default: return launch_var<scalar_t, WMAX, kVarEarly | kVarPdl>(p, stream);
  }
}

template <typename scalar_t>
cudaError_t launch(const OutputDirectParams& p, cudaStream_t stream) {
  cudaError_t err;
  if (p.W <= 2) {
    err = launch_w<scalar_t, 2>(p, stream);
  } else if (p.W <= 4) {
    err = launch_w<scalar_t, 4>(p, stream);
  } else {
    err = launch_w<scalar_t, 8>(p, stream);
  }
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <typename scalar_t, int WMAX, int kVar>
int blocks_per_sm_var() {
  int a = 0, b = 0, c = 0, d = 0, e = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, output_direct_kernel<scalar_t, WMAX, kVar>, kBlock, 0) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&d, output_direct_chunked_kernel<scalar_t, WMAX, kVar & kVarPdl>,
                                                    kBlock, 0) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(
          &e, output_direct_chunked_kernel<scalar_t, WMAX, (kVar & kVarPdl) | kVarSplit>, kBlock, 0) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&b, output_direct_ll_kernel<scalar_t, WMAX, kVar>, kBlock, 0) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&c, output_direct_ll128_kernel<scalar_t, WMAX, kVar & kVarPdl>,
                                                    kBlock, 0) != cudaSuccess) {
    return 0;
  }
  const int ab = a < b ? a : b, cd = c < d ? c : d, m = ab < cd ? ab : cd;
  return m < e ? m : e;
}

template <typename scalar_t, int WMAX>
int blocks_per_sm_w(int var) {
  switch (var) {
    case 0: return blocks_per_sm_var<scalar_t, WMAX, 0>();
    case kVarStages: return blocks_per_sm_var<scalar_t, WMAX, kVarStages>();
    case kVarEarly: return blocks_per_sm_var<scalar_t, WMAX, kVarEarly>();
    case kVarPdl: return blocks_per_sm_var<scalar_t, WMAX, kVarPdl>();
    default: return blocks_per_sm_var<scalar_t, WMAX, kVarEarly | kVarPdl>();
  }
}

template <typename scalar_t>
int blocks_per_sm_t(int W, int var) {
  return W <= 2 ? blocks_per_sm_w<scalar_t, 2>(var) : W <= 4 ? blocks_per_sm_w<scalar_t, 4>(var) : blocks_per_sm_w<scalar_t, 8>(var);
}

}  // namespace

extern "C" int peerdcp_output_direct_params_size() { return static_cast<int>(sizeof(OutputDirectParams)); }

extern "C" int peerdcp_output_direct_block() { return kBlock; }

// CTAs of the kernel for (W, dtype) that fit on one SM of the current device (0 on error). The host
// keeps G <= this * SM count, so every CTA is co-resident and no CTA waits for an unscheduled one.
// `device`: the CUDA device to use. The .so carries its own (static) CUDA runtime, whose current device
// need not follow torch's, so every entry point sets it (cheap; allowed during graph capture).
extern "C" int peerdcp_output_direct_blocks_per_sm(int W, int dtype, int device) {
  if (cudaSetDevice(device) != cudaSuccess) return 0;
  return dtype == 0 ? blocks_per_sm_t<__nv_bfloat16>(W, 0) : blocks_per_sm_t<__half>(W, 0);
}

// The same for the instantiation a call with (`stages`, `opts`) runs, minimum with the default build's.
extern "C" int peerdcp_output_direct_blocks_per_sm_variant(int W, int dtype, int device, int stages, int opts) {
  if (cudaSetDevice(device) != cudaSuccess) return 0;
  OutputDirectParams q = {};
  q.stages = stages;
  q.opts = opts;
  const int var = kernel_var(q);
  const int a = dtype == 0 ? blocks_per_sm_t<__nv_bfloat16>(W, 0) : blocks_per_sm_t<__half>(W, 0);
  const int b = dtype == 0 ? blocks_per_sm_t<__nv_bfloat16>(W, var) : blocks_per_sm_t<__half>(W, var);
  return a < b ? a : b;
}

// LL128 item indices are int32: ll128_max_tokens * NL * 8 lanes * W must stay below 2^31 (the reducer checks it
// too), and the region's rows per (slot, source) lie in [1, max_tokens].
inline bool ll128_fits(const OutputDirectParams& p) {
  const int64_t pw = int64_t(p.H) * (p.D >> 2), nl = (pw + kLineData - 1) / kLineData;
  return p.ll128_max_tokens >= 1 && p.ll128_max_tokens <= p.max_tokens &&
         int64_t(p.ll128_max_tokens) * nl * 8 * p.W < (int64_t(1) << 31) &&
         int64_t(p.T) * p.W * p.H < (int64_t(1) << 31);
}

// The parameter block is passed as void*: OutputDirectParams lives in an unnamed namespace, and a
// function whose signature names such a type gets internal linkage even when declared extern "C".
extern "C" int peerdcp_output_direct(const void* params, void* stream, int device) {
  const OutputDirectParams* p = static_cast<const OutputDirectParams*>(params);
  if (p == nullptr || p->W < 2 || p->W > kMaxWorld || p->rank < 0 || p->rank >= p->W || p->G < 1 || p->T < 1 ||
      p->D % 8 != 0 || p->heads_per_unit < 1 || p->T > p->max_tokens || p->ll_max_tokens > p->max_tokens ||
      (p->stages & ~kStagesAll) != 0 || (p->opts & ~kOptsAll) != 0 ||
      (p->stages != 0 && (p->opts & (kOptEarlyLoad | kOptPdl | kOptLL128 | kOptChunked)) != 0) ||
      ((p->opts & kOptChunked) != 0 && (p->opts & (kOptLL128 | kOptEarlyLoad)) != 0) ||
      ((p->opts & kOptSplit) != 0 && (p->opts & kOptChunked) == 0) ||
      ((p->opts & kOptLL128) != 0 && ((p->opts & kOptTightGrid) != 0 || !ll128_fits(*p)))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const cudaError_t dev_err = cudaSetDevice(device);
  if (dev_err != cudaSuccess) return static_cast<int>(dev_err);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const cudaError_t err = p->dtype == 0 ? launch<__nv_bfloat16>(*p, st) : launch<__half>(*p, st);
  return static_cast<int>(err);
}
