// peerdcp Query gather: the consumer-direct kernel in CUDA C++ (the twin of peerdcp/query/kernels.py).
//
// Same protocol, buffer layout, work split and rounding as the Triton kernel (read its module docstring
// first): NPROG blocks on every rank, block p owns units [p*ceil(T*H/NPROG), ...) of every source shard
// and only waits for the flags of its twin block p on the peers; a per-block call counter epochs[p] in
// local memory picks the parity slot, so back-to-back calls and graph replays need no host sync.
// (A flag-free push call - LL, LL12, LL128, SN - may launch fewer blocks than the object has counters, the host's
// `blocks`: its twins wait for no flag, and enter_call keeps every counter counting every call.)
//
//   publish (RAW: copy own bf16 shard into own slot e%2; ROPED: rotate+convert own rows into own slot
//            and into out; PUSH: rotate+convert own rows into out and store them into our region of
//            every peer's slot e%2; EXPOSED: nothing, the caller already wrote slot Z)
//   -> __syncthreads -> fence.acq_rel.sys + st.release.sys of ready[e%2][p][rank] in every peer
//   -> own rows (RAW / EXPOSED) while the flags fly
//   -> one thread per peer polls its local ready flag (ld.acquire.sys, %globaltimer deadline)
//   -> __syncthreads -> every thread loads the peers' rows straight from peer memory (ld.global.cg;
//      PUSH: copies the rows the peers stored into its own slot, local loads)
//   -> (EXPOSED) __syncthreads -> st.release.sys ack[p][rank] into each peer.
//
// PUSH_LL (small T; the host picks it for push calls with T <= its LL bound): the PUSH publish, but every
// 8 output bytes travel to each peer's LL area as one 16-byte line {4 data, flag, 4 data, flag}
// (st.volatile.v4, NCCL's LL), flag = 2e+1; the consumer polls its own LL area line by line
// (ld.volatile.v4) and takes a line once both flags match. No fence, no ready flag, no barrier: the
// flag round trip of PUSH is gone, at twice the bytes. Two parity areas suffice by the slot argument
// below (a rank's call e + 1 cannot finish before every peer started its call e + 1, which follows the
// peer's call e - the last reader of the area that call e + 2 writes - in stream order).
//
// PUSH_LL12 (mode 6): PUSH_LL with lines {3 data words, flag}, 3/4 data.
// PUSH_SN (mode 7): PUSH_LL's work split with no flag at all - each 8-byte word replaces a rest
// pattern in the peer's sentinel area and the consumer restores it (query/flag_in_data.cuh).
// PUSH_LL128 (mode 5; query_push_ll128_kernel): lines of 128 bytes, 15 data words and a flag word.
// PUSH_SN16 (PUSH_SN | kModeWide, interleaved RoPE): PUSH_SN with one 16-byte store per pair of words.
// The host picks among LL, SN, LL12, LL128 and the fenced PUSH by the call's bytes (peerdcp/query/policy.py).
//
// PDL (programmatic dependent launch, `mode | kModePdl`; the host sets it by default for T <= 32, where it
// measured faster - at T >= 64 it measured slower - and for every SN call, where it measured faster): the launch
// carries cudaLaunchAttributeProgrammaticStreamSerialization, and every block first executes
// griddepcontrol.wait - it returns once the preceding grid has completed and its memory is visible, the
// same guarantee as stream order, before any load or store here, so the slot/ack argument is unchanged -
// then griddepcontrol.launch_dependents, so the next PDL launch is staged while this one runs (its blocks
// start only after all of this grid's blocks issued the trigger, i.e. are resident: no block of this grid
// waits for a block that cannot be scheduled). Without the attribute both instructions are no-ops.
//
// Rounding: every product and sum is a separate IEEE fp32 operation (__fmul_rn / __fadd_rn / __fsub_rn
// are never contracted into FMA), in the reference order; FP8 is cvt.rn.satfinite (RNE, +-448), bf16
// is RNE. So the bytes equal the Triton kernels' (launched with enable_fp_fusion=False) and torch's.
// Built without --use_fast_math (no flush-to-zero).
//
// Integer arithmetic on the latency path: a call at small T is a chain of dependent instructions more than of
// memory latencies, and a division by a runtime int is ~20 of them. Every index division by a per-call divisor
// (heads, rope dims, items per unit, words per row) goes through FastDiv (peer_memory.cuh; the host computes
// the multipliers in the C entry), the source rank of a consumer item is found by subtraction (peer_of), and
// units per block come from the host (Params.upp). Measured: 0.3 us less per call at every T.
//
// Files: query/params.cuh (parameter block, memory primitives, row numerics, kernel prologue),
// query/unit_items.cuh (the unit-item path: raw / roped / fenced push / exposed publish and the consumers' copy),
// query/flag_in_data.cuh (the flag-in-data protocols LL, LL12 and LL128), and here the main kernel, the zero-copy
// ack wait and the C entry points.
#include "params.cuh"
#include "flag_in_data.cuh"
#include "unit_items.cuh"

namespace {

template <int MODE, bool NEOX, bool FP8>
__global__ void __launch_bounds__(kThreads) query_direct_kernel(const Params a) {
  constexpr int osize = FP8 ? 1 : 2;
  __shared__ int64_t e_sh;
  __shared__ int ok_sh[kMaxW];
  __shared__ __align__(16) float cs_sh[kMaxTok * kMaxRope];
  const int p = blockIdx.x, tid = threadIdx.x, W = a.W, H = a.H;
  enter_call(a, p, &e_sh);
  zero_padding(a, p, osize);
  const int n_units = a.T * H;
  const int u0 = p * a.upp;
  const int u1 = min(u0 + a.upp, n_units);
  if (u0 >= u1) return;  // after bumping the counter: every block counts every call

  const int64_t pe_region_bytes = a.max_tokens * H * (int64_t)a.NOPE * 2;
  // RAW: the first chunk of this block's shard is loaded before anything waits for the counter (the slot
  // address depends on the parity), so the load latencies overlap.
  const int n_raw = MODE == kRaw ? (u1 - u0) * (a.NOPE / 8 + a.ROPE / 8) : 0;
  uint4 pre[kUnroll];
  int64_t pre_off[kUnroll];
  if constexpr (MODE == kRaw) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = tid + k * kThreads;
      if (idx < n_raw) pre[k] = *raw_item(a, u0, idx, pe_region_bytes, pre_off[k]);
    }
  }
  // PUSH_LL / PUSH_SN with the early bit: the first round of this block's inputs is loaded before anything waits
  // (epoch, cos/sin), so those latencies overlap (the round is emitted after the barrier)
  const Sources own{a.q_nope, a.q_pe, a.s_nt, a.s_nh, a.s_pt, a.s_ph, a.rank, 1, 0, nullptr};
  Item early[kUnroll];
  if constexpr (MODE == kPushLL || MODE == kPushSN) {
    if (a.early) {
      const int n = (u1 - u0) * items_per_unit<NEOX>(a);
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        const int idx = tid + k * kThreads;
        early[k].j = -1;
        if (idx < n) load_item<NEOX, false>(early[k], a, own, u0, u1, idx);
      }
    }
  }
  // cos/sin rows of this block's tokens into shared memory (overlaps the counter load)
  const CosSin cs = stage_cos_sin(a, a.fd_h.div(u0), a.fd_h.div(u1 - 1), cs_sh);
  __syncthreads();
  const int64_t e = e_sh;
  const int par = (int)(e & 1);
  const int slot = MODE == kExposed ? kSlotZ : par;
  char* my_slot = slot_of(a, a.rank, slot);
  // PUSH_LL flag word: odd, distinct from the call e - 2 that used the same parity area and from zero
  const Pub pub{slot, (uint32_t)(2 * e + 1)};

  // ---- publish
  if constexpr (MODE == kRaw) {
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (tid + k * kThreads < n_raw) *reinterpret_cast<uint4*>(my_slot + pre_off[k]) = pre[k];
    }
    for (int base = tid + kThreads * kUnroll; base < n_raw; base += kThreads * kUnroll) {
      uint4 v[kUnroll];
      int64_t off[kUnroll];
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (base + k * kThreads < n_raw) v[k] = *raw_item(a, u0, base + k * kThreads, pe_region_bytes, off[k]);
      }
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (base + k * kThreads < n_raw) *reinterpret_cast<uint4*>(my_slot + off[k]) = v[k];
      }
    }
  } else if constexpr (MODE == kRoped) {
    compute_units<NEOX, FP8, false, kPubOwn>(a, cs, u0, u1, own, pub);
  } else if constexpr (MODE == kPush) {
    // NVLink stores straight into every peer's slot (fire-and-forget, they overlap the conversion); the
    // release below is ordered after them by the barrier, so a peer that sees our flag sees the rows
    // (8-byte FP8 stores: pairing two lanes' codes into one 16-byte store by a shuffle measured 25-35 %
    // slower at T >= 32)
    compute_units<NEOX, FP8, false, kPubPeers>(a, cs, u0, u1, own, pub);
  } else if constexpr (MODE == kPushLL) {
    // the flag travels inside every 8-byte word: no fence, no ready flag, no barrier
    publish_early<NEOX, FP8, kPubPeersLL>(a, cs, u0, u1, own, pub, early);
    if (W > 1) copy_rows_ll(a, u0, u1, par, pub.f, osize);
    return;
  } else if constexpr (MODE == kPushSN16) {  // the SN publish with 16-byte stores (interleaved RoPE)
    publish_sn16(a, cs, u0, u1, own, pub);
    if (W > 1) copy_rows_sn<2>(a, u0, u1, par, pub.f, osize);
    return;
  } else if constexpr (MODE == kPushSN) {
    // the data itself replaces the area's rest pattern: no flag bytes, no fence
    publish_early<NEOX, FP8, kPubPeersSN>(a, cs, u0, u1, own, pub, early);
    if (W > 1) copy_rows_sn<FP8 ? 1 : 2>(a, u0, u1, par, pub.f, osize);
    return;
  } else if constexpr (MODE == kPushLL12) {
    publish_ll12<NEOX, FP8>(a, cs, u0, u1, par, pub.f);
    if (W > 1) copy_rows_ll12(a, u0, u1, par, pub.f, osize);
    return;
  }
  __syncthreads();  // every thread's publish stores precede the release below
  if (tid < W && tid != a.rank)  // release: cumulative over the block's stores ordered by the barrier
    st_release_sys(flags_of(a, tid) + ((int64_t)par * a.nprog + p) * W + a.rank, e);

  // ---- own rows while the flags fly
  if constexpr (MODE == kRaw) {
    compute_units<NEOX, FP8, false, kPubNone>(a, cs, u0, u1, own, pub);
  } else if constexpr (MODE == kExposed) {
    const Sources own{reinterpret_cast<const uint16_t*>(my_slot),
                      reinterpret_cast<const uint16_t*>(my_slot + pe_region_bytes),
                      (int64_t)H * a.NOPE, a.NOPE, (int64_t)H * a.ROPE, a.ROPE, a.rank, 1, 0, nullptr};
    compute_units<NEOX, FP8, false, kPubNone>(a, cs, u0, u1, own, pub);
  }

  // ---- wait: one thread per peer polls its flag (all peers at once)
  if (tid < W) {
    ok_sh[tid] = 1;
    if (tid != a.rank)
      ok_sh[tid] = wait_flag(flags_of(a, a.rank) + ((int64_t)par * a.nprog + p) * W + tid, e, a, tid) ? 1 : 0;
  }
  __syncthreads();

  // ---- consume every peer's rows straight from its slot (one pass over all peers: their loads overlap)
  if (W > 1) {
    if constexpr (MODE == kRoped || MODE == kPush) {
      copy_rows<MODE == kPush>(a, u0, u1, slot, ok_sh, osize);
    } else {
      const Sources peers{nullptr, nullptr, 0, 0, 0, 0, -1, W - 1, slot, ok_sh};
      compute_units<NEOX, FP8, true, kPubNone>(a, cs, u0, u1, peers, pub);
    }
  }
  if constexpr (MODE == kExposed) {
    __syncthreads();  // every read of the peers' slot Z has returned (its values were stored)
    if (tid < W && tid != a.rank && ok_sh[tid])
      st_release_sys(flags_of(a, tid) + 2 * (int64_t)a.nprog * W + (int64_t)p * W + a.rank, e);
    if (tid == 0) a.last_z[p] = e;
  }
}

__global__ void query_wait_acks_kernel(const Params a) {
  const int p = blockIdx.x, tid = threadIdx.x;
  const int64_t ez = a.last_z[p];
  if (ez == 0 || tid >= a.W || tid == a.rank) return;
  wait_flag(flags_of(a, a.rank) + 2 * (int64_t)a.nprog * a.W + (int64_t)p * a.W + tid, ez, a, tid);
}

cudaError_t launch_one(void (*kernel)(const Params), const Params& a, bool pdl, cudaStream_t stream) {
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = peerdcp::launch_config(&attr, dim3(a.nprog), dim3(kThreads), 0, stream, pdl);
  const cudaError_t err = cudaLaunchKernelEx(&cfg, kernel, a);
  return err != cudaSuccess ? err : cudaGetLastError();
}

template <int MODE>
cudaError_t launch_mode(const Params& a, bool neox, bool fp8, bool pdl, cudaStream_t stream) {
  if (neox) {
    return launch_one(fp8 ? query_direct_kernel<MODE, true, true> : query_direct_kernel<MODE, true, false>, a, pdl,
                      stream);
  }
  return launch_one(fp8 ? query_direct_kernel<MODE, false, true> : query_direct_kernel<MODE, false, false>, a, pdl,
                    stream);
}

// The host's parameter block (peerdcp/query/ops.py QueryDirectParams mirrors it: same order, same types), the one
// argument of both launch entry points; the C entry fills the kernels' Params from it. Passed as void* with its
// size: QueryDirectParams lives in an unnamed namespace (a signature naming it would get internal linkage even
// declared extern "C"), and a block of another size (a stale mirror) is refused with cudaErrorInvalidValue.
struct QueryDirectParams {
  const void* q_nope;         // bf16 [T, H, NOPE], strides s_nt, s_nh (elements)
  const void* q_pe;           // bf16 [T, H, ROPE], strides s_pt, s_ph
  int64_t s_nt, s_nh, s_pt, s_ph;
  const void* pos;            // [T] int32 or int64 (pos64)
  const float* cos_sin;       // [max_pos, ROPE] fp32, rows [cos | sin]
  int64_t max_pos;
  void* out;                  // [T, HOUT, NOPE + ROPE] e4m3 (fp8) or bf16
  uint64_t peer_base[kMaxW];  // every rank's exposed buffer, as mapped in this process (W of them)
  int64_t* epochs;            // [nprog] call counters
  int64_t* last_z;            // [nprog] epoch of the last exposed call with work
  void* err;                  // int64[8] error word in pinned host memory
  int64_t timeout_ns;
  int64_t max_tokens, data_off, slot_bytes;
  int64_t ll_off, ll_max_tokens;   // LL area (LL and LL12 calls)
  int64_t ll128_off, ll128_lines;  // LL128 area
  int64_t sn_off, sn_max_tokens;   // sentinel area
  float quant_scale;
  int32_t pos64, T, rank, W, H, HOUT, NOPE, ROPE;
  int32_t nprog;   // the object's grid (its call counters)
  int32_t blocks;  // this launch's grid, 0 = nprog; fewer only for the flag-free push modes
  int32_t mode;    // kRaw .. kPushSN, plus the kMode* bits
  int32_t neox, fp8, mech;
};

inline void fill_common(Params& a, const QueryDirectParams& q) {
  for (int r = 0; r < q.W; ++r) a.peers.base[r] = q.peer_base[r];
  a.last_z = q.last_z;
  a.err = static_cast<unsigned long long*>(q.err);
  a.timeout_ns = q.timeout_ns;
  a.rank = q.rank, a.W = q.W, a.mech = q.mech;
}

}  // namespace

extern "C" int peerdcp_query_params_size() { return static_cast<int>(sizeof(QueryDirectParams)); }

extern "C" int peerdcp_query_direct(const void* params, int params_size, cudaStream_t stream) {
  if (params == nullptr || params_size != static_cast<int>(sizeof(QueryDirectParams))) {
    return (int)cudaErrorInvalidValue;
  }
  const QueryDirectParams& q = *static_cast<const QueryDirectParams*>(params);
  const int T = q.T, W = q.W, H = q.H, NOPE = q.NOPE, ROPE = q.ROPE, nprog = q.nprog, mode = q.mode;
  const int neox = q.neox, fp8 = q.fp8;
  const int64_t ll_max_tokens = q.ll_max_tokens, ll128_lines = q.ll128_lines, sn_max_tokens = q.sn_max_tokens;
  int blocks = q.blocks;
  if (W < 1 || W > kMaxW || NOPE % 16 || ROPE % 16 || nprog < 1) return (int)cudaErrorInvalidValue;
  // blocks: this launch's grid, 0 = nprog; fewer only for the flag-free push modes (LL, LL12, LL128, SN: no block
  // waits for a twin block's flag, so the twins need not be the same blocks from call to call)
  const int base_mode = mode & ~kModeBits;
  const bool flag_free =
      base_mode == kPushLL || base_mode == kPushLL12 || base_mode == kPushLL128 || base_mode == kPushSN;
  if (blocks == 0) blocks = nprog;
  if (blocks < 1 || blocks > nprog || (blocks < nprog && !flag_free)) return (int)cudaErrorInvalidValue;
  Params a{};
  fill_common(a, q);
  a.q_nope = static_cast<const uint16_t*>(q.q_nope);
  a.q_pe = static_cast<const uint16_t*>(q.q_pe);
  a.s_nt = q.s_nt, a.s_nh = q.s_nh, a.s_pt = q.s_pt, a.s_ph = q.s_ph;
  a.pos = q.pos, a.pos64 = q.pos64, a.cos_sin = q.cos_sin, a.max_pos = q.max_pos;
  a.out = q.out;
  a.epochs = q.epochs;
  a.quant_scale = q.quant_scale;
  a.T = T, a.H = H, a.HOUT = q.HOUT, a.NOPE = NOPE, a.ROPE = ROPE;
  a.nprog = blocks, a.ncnt = nprog;
  a.upp = (T * H + blocks - 1) / blocks;
  const int row_bytes = (NOPE + ROPE) * (fp8 ? 1 : 2);
  a.fd_h = FastDiv::make(H), a.fd_rope = FastDiv::make(ROPE);
  a.fd_ipu[0] = FastDiv::make(NOPE / 8 + ROPE / 8), a.fd_ipu[1] = FastDiv::make(NOPE / 8 + ROPE / 16);
  a.fd_w8 = FastDiv::make(row_bytes / 8), a.fd_w16 = FastDiv::make(row_bytes / 16);
  a.max_tokens = q.max_tokens, a.data_off = q.data_off, a.slot_bytes = q.slot_bytes;
  a.ll_off = q.ll_off, a.ll_max_tokens = ll_max_tokens;
  a.ll128_off = q.ll128_off, a.ll128_lines = ll128_lines;
  a.sn_off = q.sn_off, a.sn_max_tokens = sn_max_tokens;
  a.early = (mode & kModeEarly) != 0;
  if ((mode & kModeEarly) && base_mode != kPushLL && base_mode != kPushSN) return (int)cudaErrorInvalidValue;
  // the wide bit: SN with interleaved RoPE only (its pairs are output words 2i, 2i + 1 of one row); it
  // loads its own rounds (no early load)
  const bool wide = (mode & kModeWide) != 0;
  if (wide && (base_mode != kPushSN || neox || (mode & kModeEarly))) return (int)cudaErrorInvalidValue;
  if (T <= 0) return (int)cudaSuccess;
  const bool pdl = (mode & kModePdl) != 0;
  switch (base_mode) {
    case kRaw:
      return (int)launch_mode<kRaw>(a, neox != 0, fp8 != 0, pdl, stream);
    case kRoped:
      return (int)launch_mode<kRoped>(a, neox != 0, fp8 != 0, pdl, stream);
    case kExposed:
      return (int)launch_mode<kExposed>(a, neox != 0, fp8 != 0, pdl, stream);
    case kPush:
      return (int)launch_mode<kPush>(a, neox != 0, fp8 != 0, pdl, stream);
    case kPushLL:
      if (T > ll_max_tokens) return (int)cudaErrorInvalidValue;  // the LL area holds ll_max_tokens rows
      return (int)launch_mode<kPushLL>(a, neox != 0, fp8 != 0, pdl, stream);
    case kPushLL12:
      if (T > ll_max_tokens || (NOPE + ROPE) * (fp8 ? 1 : 2) % (8 * kTriple)) return (int)cudaErrorInvalidValue;
      return (int)launch_mode<kPushLL12>(a, neox != 0, fp8 != 0, pdl, stream);
    case kPushSN:  // the area holds sn_max_tokens rows; the wide kernel is FP8 only
      if (T > sn_max_tokens || (wide && !fp8)) return (int)cudaErrorInvalidValue;
      if (wide) return (int)launch_one(query_direct_kernel<kPushSN16, false, true>, a, pdl, stream);
      return (int)launch_mode<kPushSN>(a, neox != 0, fp8 != 0, pdl, stream);
    case kPushLL128: {
      // the LL128 area holds ll128_lines lines per source: ceil(T * H * D * osize / 8 / 15) of them
      const int64_t words = (int64_t)T * H * (NOPE + ROPE) * (fp8 ? 1 : 2) / 8;
      if ((words + kLineData - 1) / kLineData > ll128_lines) return (int)cudaErrorInvalidValue;
      auto k = neox ? (fp8 ? query_push_ll128_kernel<true, true> : query_push_ll128_kernel<true, false>)
                    : (fp8 ? query_push_ll128_kernel<false, true> : query_push_ll128_kernel<false, false>);
      return (int)launch_one(k, a, pdl, stream);
    }
    default:
      return (int)cudaErrorInvalidValue;
  }
}

// Blocks of the PUSH_SN kernel (NeoX or interleaved RoPE, FP8 or BF16) that fit on one SM at once: the host
// sizes the grid of an object whose copy calls use the sentinel push by it (QueryGather: at most
// QueryPolicy.cuda_sn_programs_per_sm).
extern "C" int peerdcp_query_sn_blocks_per_sm(int neox, int fp8, int* blocks) {
  void (*const kernels[2][2])(const Params) = {
      {query_direct_kernel<kPushSN, false, false>, query_direct_kernel<kPushSN, false, true>},
      {query_direct_kernel<kPushSN, true, false>, query_direct_kernel<kPushSN, true, true>}};
  cudaError_t err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(blocks, kernels[neox != 0][fp8 != 0], kThreads, 0);
  if (err != cudaSuccess || neox || !fp8) return (int)err;
  int wide = 0;  // interleaved objects also launch the SN16 kernel: the grid must fit for both
  err = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&wide, query_direct_kernel<kPushSN16, false, true>, kThreads, 0);
  *blocks = wide < *blocks ? wide : *blocks;
  return (int)err;
}

// FastDiv::make's multiplier and shift for divisor d (host code; tests/test_fastdiv.py checks them against the
// verified formula, so a change to make() that breaks it fails on any machine with nvcc, GPU or not).
extern "C" void peerdcp_fastdiv_make(int d, uint32_t* m, uint32_t* s) {
  const FastDiv f = FastDiv::make(d);
  *m = f.m;
  *s = f.s;
}

// The zero-copy ack wait: uses the block's peer_base, last_z, err, timeout_ns, rank, W, nprog and mech.
extern "C" int peerdcp_query_wait_acks(const void* params, int params_size, cudaStream_t stream) {
  if (params == nullptr || params_size != static_cast<int>(sizeof(QueryDirectParams))) {
    return (int)cudaErrorInvalidValue;
  }
  const QueryDirectParams& q = *static_cast<const QueryDirectParams*>(params);
  if (q.W < 1 || q.W > kMaxW || q.nprog < 1) return (int)cudaErrorInvalidValue;
  Params a{};
  fill_common(a, q);
  a.nprog = q.nprog, a.ncnt = q.nprog;
  query_wait_acks_kernel<<<q.nprog, 32, 0, stream>>>(a);
  return (int)cudaGetLastError();
}
