// Output/LSE CUDA kernels (see output/direct.cu), part 3: the opt-in chunked kernel (the plain protocol
// released per chunk of units by a signalling warp).
#pragma once

#include "params.cuh"

namespace {

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
__device__ __forceinline__ bool wait_chunk(const int64_t* flag, int64_t target, const OutputKernelParams& p, int peer) {
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
__global__ void __launch_bounds__(kBlock) output_direct_chunked_kernel(const __grid_constant__ OutputKernelParams p) {
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
  const int64_t fv = call_flag(e, p.T);
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

}  // namespace
