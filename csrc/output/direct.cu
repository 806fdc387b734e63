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
// For T <= ll_max_tokens the host's launch picks the LL twin (output_direct_ll_kernel, output/flag_in_data.cuh): flags
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
//   kOptLL128      calls with ll_max_tokens < T <= ll128_max_tokens run output_direct_ll128_kernel
//                  (output/flag_in_data.cuh; flags inside 128-byte lines, NCCL's LL128) instead of the plain kernel.
//                  Not with kOptTightGrid (the LL128 reader of an LSE word may be another CTA than its writer, so
//                  every CTA must run in every call). The host sets it per call: for T in the band
//                  (max(ll_max, ll128_min), ll128_max] (default (20, 48], measured faster there) or, with the
//                  "ll128" option, every T > ll_max.
//                  The C side only checks T <= ll128_max_tokens. LL, LL128 and plain calls interleave freely:
//                  each has its own region, all three advance every CTA's epoch, and the two-slot argument
//                  holds per region.
//   kOptChunked    calls with T > ll_max_tokens run output_direct_chunked_kernel (output/chunked.cuh; the
//                  plain protocol released per chunk of units by a signalling warp). Not with kOptLL128 or
//                  kOptEarlyLoad.
//   kOptSplit      with kOptChunked only: separate publishing and combining warps in that kernel.
//   kOptSentinel   calls with T > ll_max_tokens outside the LL128 band run output_direct_sentinel_kernel
//                  (output/sentinel.cuh; the payload region holds a reserved 16-bit pattern at rest, so each
//                  vector signals its own arrival: no fence, no flag bytes). The host sets it per call
//                  (T > OutputPolicy.cuda_sentinel_min_tokens). Not with kOptTightGrid or kOptChunked.
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
//
// Files: output/params.cuh (parameter block, prologue, geometry, item loads, the combine rule),
// output/flag_in_data.cuh (the LL and LL128 kernels), output/chunked.cuh (the chunked kernel), output/sentinel.cuh
// (the sentinel kernel), and here the plain kernel, the launch and the C entry points.
#include "chunked.cuh"
#include "params.cuh"
#include "flag_in_data.cuh"
#include "sentinel.cuh"

namespace {

template <typename scalar_t, int WMAX, int kVar>
__global__ void __launch_bounds__(kBlock) output_direct_kernel(const __grid_constant__ OutputKernelParams p) {
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
  __shared__ int s_ok;
  advance_epoch(p, prog, &s_epoch);
  if (tid == 0) s_ok = 1 << p.rank;
  __syncthreads();
  const int64_t e = s_epoch;
  const int slot = static_cast<int>(e & 1);
  const int64_t fv = call_flag(e, p.T);
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

// Launch one instantiation: with PDL through cudaLaunchKernelEx (capturable: a programmatic graph edge).
template <int kVar>
cudaError_t launch_one(void (*kernel)(const OutputKernelParams), int grid, const OutputKernelParams& p,
                       cudaStream_t stream) {
  if constexpr ((kVar & kVarPdl) == 0) {
    kernel<<<dim3(grid), dim3(kBlock), 0, stream>>>(p);
    return cudaSuccess;
  } else {
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg = peerdcp::launch_config(&attr, dim3(grid), dim3(kBlock), 0, stream, true);
    return cudaLaunchKernelEx(&cfg, kernel, p);
  }
}

template <typename scalar_t, int WMAX, int kVar>
cudaError_t launch_var(const OutputKernelParams& p, cudaStream_t stream) {
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
  if (p.opts & kOptSentinel) {  // every CTA, every call (see the sentinel notes)
    constexpr int kVarSn = kVar & kVarPdl;
    return launch_one<kVarSn>(output_direct_sentinel_kernel<scalar_t, WMAX, kVarSn>, p.G, p, stream);
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
cudaError_t launch_w(const OutputKernelParams& p, cudaStream_t stream) {
  switch (kernel_var(p)) {
    case 0: return launch_var<scalar_t, WMAX, 0>(p, stream);
    case kVarStages: return launch_var<scalar_t, WMAX, kVarStages>(p, stream);
    case kVarEarly: return launch_var<scalar_t, WMAX, kVarEarly>(p, stream);
    case kVarPdl: return launch_var<scalar_t, WMAX, kVarPdl>(p, stream);
    default: return launch_var<scalar_t, WMAX, kVarEarly | kVarPdl>(p, stream);
  }
}

template <typename scalar_t>
cudaError_t launch(const OutputKernelParams& p, cudaStream_t stream) {
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
  int a = 0, b = 0, c = 0, d = 0, e = 0, f = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&a, output_direct_kernel<scalar_t, WMAX, kVar>, kBlock, 0) !=
          cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&f, output_direct_sentinel_kernel<scalar_t, WMAX, kVar & kVarPdl>,
                                                    kBlock, 0) != cudaSuccess ||
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
  const int ab = a < b ? a : b, cd = c < d ? c : d, m = ab < cd ? ab : cd, ef = e < f ? e : f;
  return m < ef ? m : ef;
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
      (p->stages != 0 && (p->opts & (kOptEarlyLoad | kOptPdl | kOptLL128 | kOptChunked | kOptSentinel)) != 0) ||
      ((p->opts & kOptSentinel) != 0 &&
       ((p->opts & (kOptTightGrid | kOptChunked)) != 0 || p->sn_pub < 0 || p->sn_loads < 1 || p->sn_loads > 2 ||
        int64_t(p->T) * p->H * (p->D >> 3) >= (int64_t(1) << 31))) ||
      ((p->opts & kOptChunked) != 0 && (p->opts & (kOptLL128 | kOptEarlyLoad)) != 0) ||
      ((p->opts & kOptSplit) != 0 && (p->opts & kOptChunked) == 0) ||
      ((p->opts & kOptLL128) != 0 && ((p->opts & kOptTightGrid) != 0 || !ll128_fits(*p)))) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  const cudaError_t dev_err = cudaSetDevice(device);
  if (dev_err != cudaSuccess) return static_cast<int>(dev_err);
  cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
  const OutputKernelParams q = derive_params(*p);  // the call's fixed divisors
  const cudaError_t err = q.dtype == 0 ? launch<__nv_bfloat16>(q, st) : launch<__half>(q, st);
  return static_cast<int>(err);
}
