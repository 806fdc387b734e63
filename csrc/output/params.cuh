// Output/LSE CUDA kernels (see output/direct.cu), part 1: constants, the parameter block (mirrored by
// peerdcp/output/ops.py), the kernel prologue (PDL, epoch), the work geometry, the publish / LSE item loads
// and the combine rule that every kernel of the library shares.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "peer_memory.cuh"

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
// The 64-bit flag of call `e` with T tokens, the same in every protocol: a peer that called with another T never
// matches (its wait times out instead of combining rows of another shape). T < kTokenSpace (host check).
__device__ __forceinline__ int64_t call_flag(int64_t e, int T) { return e * kTokenSpace + T; }

// `stages` bits (benchmark-only breakdown; mirrors peerdcp/output/ops.py STAGE_*)
constexpr int kSkipPayload = 1, kSkipLse = 2, kSkipSync = 4, kSkipCombine = 8, kStageEmpty = 16,
              kStageInstrumented = 32;
constexpr int kStagesAll = kSkipPayload | kSkipLse | kSkipSync | kSkipCombine | kStageEmpty | kStageInstrumented;
// `opts` bits (opt-in variants; mirrors peerdcp/output/ops.py OPT_*)
constexpr int kOptTightGrid = 1, kOptEarlyLoad = 2, kOptPdl = 4, kOptLL128 = 8, kOptChunked = 16, kOptSplit = 32,
              kOptSentinel = 64;
constexpr int kOptsAll = kOptTightGrid | kOptEarlyLoad | kOptPdl | kOptLL128 | kOptChunked | kOptSplit | kOptSentinel;
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
  int32_t sn_pub;           // with kOptSentinel: publisher CTAs [0, sn_pub), the others combine; 0 (or >= G):
                            // every CTA publishes, then combines (chosen per call from T by the host)
  int32_t sn_loads;         // with kOptSentinel: 16-byte loads in flight per publishing thread, 1 or 2 (per call)
  int64_t sn_off;           // sentinel region: payload (see output_direct_sentinel_kernel)
  int64_t sn_lse_off;       // ... and its LSE words
  int64_t* dbg;             // diagnosis only (nullptr in every public path): sentinel kernel timeline, [G][4] int64
};

// What the kernels receive: the mirrored block plus the call's fixed divisors, derived once per call by the C
// entry (derive_params). An index division by a runtime int is ~20 dependent instructions on a small call's
// latency path; FastDiv is two (the LL kernel measured 0.13-0.18 us faster per call at T = 1-4 and the same at
// T = 8, the Query kernels 0.3 us). The sentinel kernel keeps its divisions (output/sentinel.cuh
// says why).
using peerdcp::FastDiv;
struct OutputKernelParams : OutputDirectParams {
  FastDiv fd_g;    // CTAs (G)
  FastDiv fd_nc;   // head chunks per token, NC = ceil(H / heads_per_unit)
  FastDiv fd_uv;   // 16-byte vectors per unit and destination, UV = heads_per_unit * D / 8
  FastDiv fd_pu;   // publish items per unit, (W - 1) * UV
  FastDiv fd_lpu;  // LSE items per unit, (W - 1) * heads_per_unit
  FastDiv fd_hu;   // heads_per_unit
  FastDiv fd_vh;   // 16-byte vectors per head, D / 8
};
inline OutputKernelParams derive_params(const OutputDirectParams& p) {
  OutputKernelParams q;
  static_cast<OutputDirectParams&>(q) = p;
  const int hu = p.heads_per_unit, vh = p.D >> 3;
  q.fd_g = FastDiv::make(p.G);
  q.fd_nc = FastDiv::make((p.H + hu - 1) / hu);
  q.fd_uv = FastDiv::make(hu * vh);
  q.fd_pu = FastDiv::make((p.W - 1) * hu * vh);
  q.fd_lpu = FastDiv::make((p.W - 1) * hu);
  q.fd_hu = FastDiv::make(hu);
  q.fd_vh = FastDiv::make(vh);
  return q;
}

// With PDL (kVarPdl), the first thing every CTA does: griddepcontrol.wait returns once the preceding grid
// (the previous call) has completed and its memory is visible, before any load or store here; then allow
// the next PDL launch to be staged.
template <int kVar>
__device__ __forceinline__ void pdl_enter() {
  if constexpr ((kVar & kVarPdl) != 0) {
    peerdcp::griddep_wait();
    peerdcp::griddep_launch_dependents();
  }
}

// This call's epoch of CTA prog: thread 0 bumps epochs[prog] (only CTA prog ever touches it, so no atomic)
// and leaves the value in shared memory; the caller's __syncthreads hands it to the whole CTA.
__device__ __forceinline__ void advance_epoch(const OutputKernelParams& p, int prog, int64_t* s_epoch) {
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

__device__ __forceinline__ Geo make_geo(const OutputKernelParams& p, int prog) {
  Geo g;
  g.W = p.W, g.H = p.H, g.rank = p.rank, g.G = p.G;
  g.HU = p.heads_per_unit;
  g.NC = p.fd_nc.d;  // ceil(H / HU)
  g.n_units = p.T * g.NC;
  g.VH = p.D >> 3;                    // 16-byte vectors per head
  g.UV = g.HU * g.VH;                 // vectors per unit and destination
  g.HV = int64_t(g.H) * g.VH;         // vectors per (token, source) slice
  g.WHV = int64_t(g.W) * g.HV;        // vectors per token of partial_out
  g.my_units = prog < g.n_units ? p.fd_g.div(g.n_units - 1 - prog) + 1 : 0;
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
__device__ __forceinline__ void pub_load(const OutputKernelParams& p, const Geo& g, int prog, int i0, PubRound& r,
                                         int stride = kBlock, int end = -1) {
  const uint4* src = reinterpret_cast<const uint4*>(p.partial_out);
  if (end < 0) end = g.pub_items;
#pragma unroll
  for (int k = 0; k < kPubUnroll; ++k) {
    r.d[k] = -1;
    const int i = i0 + k * stride;
    if (i < end) {
      const int ku = p.fd_pu.div(i);
      const int rr = i - ku * g.per_unit;
      const int dj = p.fd_uv.div(rr);
      const int vi = rr - dj * g.UV;
      const int u = prog + ku * g.G;
      const int t = p.fd_nc.div(u);
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

__device__ __forceinline__ void lse_load(const OutputKernelParams& p, const Geo& g, int prog, int i, LseItem& it) {
  it.d = -1;
  if (i < g.lse_items) {
    const int ku = p.fd_lpu.div(i);
    const int rr = i - ku * g.lse_per_unit;
    const int dj = p.fd_hu.div(rr);
    const int u = prog + ku * g.G;
    const int t = p.fd_nc.div(u);
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

// kOptEarlyLoad (kVarEarly): a thread's first publish round and LSE item are loaded before the epoch read and
// its barrier, so those latencies overlap; the publish loops then skip reloading item `threadIdx.x`.
template <int kVar>
__device__ __forceinline__ void early_loads(const OutputKernelParams& p, const Geo& g, int prog, PubRound& pr,
                                            LseItem& li) {
  if constexpr ((kVar & kVarEarly) != 0) {
    if (prog < g.n_units) {
      pub_load(p, g, prog, threadIdx.x, pr);
      lse_load(p, g, prog, threadIdx.x, li);
    }
  }
}

__device__ __forceinline__ float sanitize(float l) { return (l < INFINITY) ? l : -INFINITY; }  // NaN, +inf -> -inf

// The combine rule for one output vector (8 elements) from W sources: own source `rank` in (own_l, own_v),
// the others in (l[s], x[s]). A source with weight 0 is dropped by a select (its payload is never used).
template <typename scalar_t, int WMAX>
__device__ __forceinline__ void combine_store(const OutputKernelParams& p, float own_l, uint4 own_v,
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
__device__ __forceinline__ bool decode_item(const OutputKernelParams& p, int prog, int NC, int UV, int items, int i,
                                            int& t, int& h, int& j) {
  if (i >= items) return false;
  const int VH = p.D >> 3, HU = p.heads_per_unit;
  const int ku = p.fd_uv.div(i);  // UV
  const int vi = i - ku * UV;
  const int u = prog + ku * p.G;
  t = p.fd_nc.div(u);  // NC
  const int h0 = (u - t * NC) * HU;
  if (vi >= min(HU, p.H - h0) * VH) return false;
  const int dh = p.fd_vh.div(vi);
  h = h0 + dh;
  j = vi - dh * VH;
  return true;
}

}  // namespace
