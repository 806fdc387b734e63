// Query gather CUDA kernels (see query/direct.cu), part 1: the parameter block, memory primitives, row
// numerics (bf16 -> fp32 -> e4m3 / bf16, RoPE; every product and sum a separate IEEE fp32 operation) and the
// kernel prologue every kernel of the library shares.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "peer_memory.cuh"

namespace {

constexpr int kMaxW = 8;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxTok = 8;     // cos/sin rows cached in shared memory per block
constexpr int kMaxRope = 256;  // rope dims the shared cache holds
constexpr int kRaw = 0, kRoped = 1, kExposed = 2, kPush = 3, kPushLL = 4, kPushLL128 = 5, kPushLL12 = 6;
constexpr int kPushSN = 7;  // the sentinel push (query/flag_in_data.cuh)
constexpr int kPushSN16 = 64 + kPushSN;  // its 16-byte-store kernel: a template value (the ABI: kPushSN | kModeWide)
constexpr int kSlotZ = 2;
// Where a publish also writes each converted row: nowhere, our own slot (ROPED), our region of every
// peer's slot (PUSH), our region of every peer's LL area (PUSH_LL) or sentinel area (PUSH_SN).
constexpr int kPubNone = 0, kPubOwn = 1, kPubPeers = 2, kPubPeersLL = 3, kPubPeersSN = 4;
constexpr int kModePdl = 8;     // `mode` bit: launch with programmatic dependent launch (query/direct.cu)
constexpr int kModeEarly = 16;  // `mode` bit: PUSH_LL / PUSH_SN load their first round of inputs before the barrier
constexpr int kModeWide = 32;   // `mode` bit: PUSH_SN (interleaved RoPE) publishes pairs of words, 16-byte stores
constexpr int kModeBits = kModePdl | kModeEarly | kModeWide;

struct Peers {
  uint64_t base[kMaxW];
};

using peerdcp::FastDiv;  // index division by the call's fixed divisors (peer_memory.cuh)

struct Params {
  const uint16_t* q_nope;  // bf16 [T, H, NOPE], strides s_nt, s_nh (elements)
  const uint16_t* q_pe;    // bf16 [T, H, ROPE], strides s_pt, s_ph
  int64_t s_nt, s_nh, s_pt, s_ph;
  const void* pos;         // [T] int32 or int64
  int pos64;
  const float* cos_sin;    // [max_pos, ROPE] fp32, rows [cos | sin]
  int64_t max_pos;
  void* out;               // [T, HOUT, D] e4m3 or bf16
  Peers peers;             // every rank's exposed buffer in this process
  int64_t* epochs;         // [NPROG] local call counters
  int64_t* last_z;         // [NPROG] epoch of the last exposed call with work (acks to wait for)
  unsigned long long* err; // int64[8] error word in pinned host memory
  int64_t timeout_ns;
  float quant_scale;
  int T, rank, W, H, HOUT, NOPE, ROPE, nprog, mech;
  int64_t max_tokens, data_off, slot_bytes;
  int64_t ll_off, ll_max_tokens;  // PUSH_LL area: [2 parity][W src][ll_max_tokens][H][2 * D * osize] bytes
  int64_t ll128_off, ll128_lines; // PUSH_LL128 area: [2 parity][W src][ll128_lines] 128-byte lines
  int early;                      // PUSH_LL / _SN: load the first round of inputs before the epoch / cos-sin barrier
  int64_t sn_off, sn_max_tokens;  // PUSH_SN area: [2 parity][W src][sn_max_tokens][H][D] out-dtype rows, at rest 0xFF
  int ncnt;  // call counters (the object's grid); nprog (this launch's grid) is smaller only for flag-free modes
  int upp;   // units per block of this launch, ceil(T * H / nprog)
  // the call's fixed divisors: heads, rope dims, work items per unit (interleaved, NeoX: items_per_unit),
  // 8- and 16-byte words per output row (D * osize / 8, / 16)
  FastDiv fd_h, fd_rope, fd_ipu[2], fd_w8, fd_w16;
};

// Where a publish's extra rows go: the parity slot (or LL area parity) and, PUSH_LL, this call's flag.
struct Pub {
  int slot;
  uint32_t f;
};

// ------------------------------------------------------------------------------------ primitives
__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}
__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}
__device__ __forceinline__ uint64_t globaltimer() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
__device__ __forceinline__ uint4 ld_cg(const uint4* p) { return __ldcg(p); }

// Record a timed-out wait (rank, peer, mechanism, awaited value): the shared helper writes the fields before
// the "set" word, so the host (which reads "set" first, without synchronizing) never sees "set" with stale
// fields.
__device__ __forceinline__ void record_timeout(const Params& a, int peer, int64_t value) {
  peerdcp::report_timeout(reinterpret_cast<int64_t*>(a.err), a.rank, peer, a.mech, value);
}

// Bounded acquire wait; on timeout record (rank, peer, mechanism, epoch) once and return false.
__device__ bool wait_flag(const int64_t* flag, int64_t value, const Params& a, int peer) {
  if (ld_acquire_sys(flag) == value) return true;
  const uint64_t t0 = globaltimer();
  while (true) {
    if (ld_acquire_sys(flag) == value) return true;
    if ((int64_t)(globaltimer() - t0) > a.timeout_ns) break;
  }
  record_timeout(a, peer, value);
  return false;
}

__device__ __forceinline__ int64_t* flags_of(const Params& a, int r) {
  return reinterpret_cast<int64_t*>(a.peers.base[r]);
}
__device__ __forceinline__ char* slot_of(const Params& a, int r, int slot) {
  return reinterpret_cast<char*>(a.peers.base[r]) + a.data_off + (int64_t)slot * a.slot_bytes;
}
// Rank i places after this one (0 <= i < 2W).
__device__ __forceinline__ int rank_after(const Params& a, int i) {
  const int r = a.rank + i;
  return r >= a.W ? r - a.W : r;
}
// Source rank of item idx (< (W - 1) * per_src) of a consumer pass over every peer's items (per_src each, the
// peers after this rank in turn) and, in *rem, its index within that source's items (subtractions: at most W - 2
// of them, against a division by a per-block count).
__device__ __forceinline__ int peer_of(const Params& a, int idx, int per_src, int* rem) {
  int i = 1;
  while (idx >= per_src) {
    idx -= per_src;
    ++i;
  }
  *rem = idx;
  return rank_after(a, i);
}
// PUSH slot: source s's finished rows [max_tokens, H, D] (out dtype) start at s * push_region(a, osize).
__device__ __forceinline__ int64_t push_region(const Params& a, int osize) {
  return a.max_tokens * a.H * (int64_t)(a.NOPE + a.ROPE) * osize;
}
// PUSH_LL area (offset from a rank's buffer base) of parity `par`, source `src`: the finished rows as LL
// lines, output bytes [8q, 8q + 8) of a row in the 16-byte line q = {w0, f, w1, f} (NCCL's LL: an aligned
// 8-byte {data, flag} word is seen whole, so a reader that sees both flags of a line sees its data).
__device__ __forceinline__ int64_t ll_region(const Params& a, int par, int src, int osize) {
  return a.ll_off + (int64_t)(par * a.W + src) * a.ll_max_tokens * a.H * 2 * (int64_t)(a.NOPE + a.ROPE) * osize;
}

// PUSH_SN: the rest state of every 8-byte word of the sentinel area - all bits set. FP8: eight e4m3 codes 0xFF
// (-NaN), which the conversion (cvt.rn.satfinite: NaN -> the canonical 0x7F) never produces; sn_word() keeps it
// so even if a conversion did: a word equal to the rest state goes out with its top code 0x7F (NaN as well).
// BF16: a half 0xFFFF (-NaN) can pass through from the input (the nope part is copied bit for bit), so
// sn_word_bf16() sends every such half as the canonical NaN 0x7FC0 - the one place where an SN call's bytes
// can differ from the other exchanges' (a NaN stays a NaN). Mirrored in Python by peerdcp/query/sentinel.py
// (tests/test_query_sentinel.py checks the rules exhaustively on the host).
constexpr uint64_t kSnRest = ~0ull;
__device__ __forceinline__ uint64_t sn_word(uint2 v) {
  const uint64_t w = ((uint64_t)v.y << 32) | v.x;
  return w == kSnRest ? (kSnRest >> 1) : w;
}
__device__ __forceinline__ uint32_t sn_bf16_pair(uint32_t w) {  // 0xFFFF halves -> 0x7FC0 (0xFFFF ^ 0x803F)
  return w ^ (__vcmpeq2(w, 0xffffffffu) & 0x803f803fu);
}
__device__ __forceinline__ uint64_t sn_word_bf16(uint32_t lo, uint32_t hi) {
  return ((uint64_t)sn_bf16_pair(hi) << 32) | sn_bf16_pair(lo);
}

// Byte `off` of the buffer of the i-th peer after this rank (1 <= i < W), as 8-byte words (the SN stores).
__device__ __forceinline__ uint64_t* peer_word(const Params& a, int i, int64_t off) {
  return reinterpret_cast<uint64_t*>(reinterpret_cast<char*>(a.peers.base[rank_after(a, i)]) + off);
}

// PUSH_SN area (offset from a rank's buffer base) of parity `par`, source `src`: the finished rows
// [sn_max_tokens, H, D] of the out dtype (osize bytes), unit-major as in a push region; every 8-byte word not
// (yet) written holds kSnRest.
__device__ __forceinline__ int64_t sn_region(const Params& a, int par, int src, int osize) {
  return a.sn_off + (int64_t)(par * a.W + src) * a.sn_max_tokens * a.H * (int64_t)(a.NOPE + a.ROPE) * osize;
}

__device__ __forceinline__ void bf16x8(const uint4 v, float f[8]) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    f[2 * i] = __uint_as_float(w[i] << 16);
    f[2 * i + 1] = __uint_as_float(w[i] & 0xffff0000u);
  }
}

// 8 fp32 -> 8 e4m3 (x quant_scale) packed in a uint2, element 0 in the lowest byte.
__device__ __forceinline__ uint2 to_fp8x8(const float f[8], float scale) {
  uint32_t h[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 v = make_float2(__fmul_rn(f[2 * i], scale), __fmul_rn(f[2 * i + 1], scale));
    h[i] = (uint32_t)__nv_cvt_float2_to_fp8x2(v, __NV_SATFINITE, __NV_E4M3);
  }
  return make_uint2(h[0] | (h[1] << 16), h[2] | (h[3] << 16));
}

// 8 fp32 -> 8 bf16 (RNE) packed in a uint4, element 0 in the lowest half.
__device__ __forceinline__ uint4 to_bf16x8(const float f[8]) {
  uint32_t w[4];
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const uint32_t lo = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i]));
    const uint32_t hi = __bfloat16_as_ushort(__float2bfloat16_rn(f[2 * i + 1]));
    w[i] = lo | (hi << 16);
  }
  return make_uint4(w[0], w[1], w[2], w[3]);
}

__device__ __forceinline__ float rot0(float x0, float x1, float c, float s) {
  return __fsub_rn(__fmul_rn(x0, c), __fmul_rn(x1, s));
}
__device__ __forceinline__ float rot1(float x0, float x1, float c, float s) {
  return __fadd_rn(__fmul_rn(x0, s), __fmul_rn(x1, c));
}

// Per block: the cos/sin rows of the tokens its units touch (shared memory when they fit).
struct CosSin {
  const float* sh;  // [ntok, ROPE] or nullptr
  int t_first;
  __device__ __forceinline__ const float* row(const Params& a, int t) const {
    if (sh != nullptr) return sh + (int64_t)(t - t_first) * a.ROPE;
    int64_t p = a.pos64 ? static_cast<const int64_t*>(a.pos)[t] : static_cast<const int32_t*>(a.pos)[t];
    p = p < 0 ? 0 : (p >= a.max_pos ? a.max_pos - 1 : p);
    return a.cos_sin + p * a.ROPE;
  }
};

__device__ __forceinline__ void* out_row(const Params& a, int t, int widened_head, int osize) {
  return static_cast<char*>(a.out) + ((int64_t)t * a.HOUT + widened_head) * (int64_t)(a.NOPE + a.ROPE) * osize;
}

// Kernel prologue, every block of every call: PDL wait (the previous grid is complete and visible) and
// trigger, then bump this block's call counter epochs[p] into *e_sh.
// Every counter holds the number of calls so far. A launch of fewer blocks than counters (a.nprog < a.ncnt:
// a small LL / SN call, whose blocks wait for no flag of a twin block) has block p count for the counters
// p + k * nprog too, thread k each (its own load and store: no other thread or block of this call touches that
// counter), so every counter still counts every call. A whole-grid launch: thread 0, counter p, as before.
__device__ __forceinline__ void enter_call(const Params& a, int p, int64_t* e_sh) {
  peerdcp::griddep_wait();
  peerdcp::griddep_launch_dependents();
#pragma unroll 1
  for (int q = p + (int)threadIdx.x * a.nprog; q < a.ncnt; q += (int)blockDim.x * a.nprog) {
    const int64_t e = a.epochs[q] + 1;
    a.epochs[q] = e;
    if (q == p) *e_sh = e;
  }
}

// Padding heads [W*H, HOUT): block p zeroes every NPROG-th row.
__device__ __forceinline__ void zero_padding(const Params& a, int p, int osize) {
  const int npad = a.HOUT - a.W * a.H;
  if (npad > 0) {
    const int vec = (a.NOPE + a.ROPE) * osize / 16;
    for (int r = p; r < a.T * npad; r += a.nprog) {
      char* row = static_cast<char*>(out_row(a, r / npad, a.W * a.H + r % npad, osize));
      for (int j = threadIdx.x; j < vec; j += blockDim.x) reinterpret_cast<uint4*>(row)[j] = make_uint4(0, 0, 0, 0);
    }
  }
}

// The cos/sin rows of tokens [t_first, t_last] into shared memory `sh` when they fit (else rows are read
// from the table per use). The caller's next __syncthreads() publishes them.
__device__ __forceinline__ CosSin stage_cos_sin(const Params& a, int t_first, int t_last, float* sh) {
  CosSin cs{nullptr, t_first};
  const int ntok = t_last - t_first + 1;
  if (ntok <= kMaxTok && a.ROPE <= kMaxRope) {
    for (int i = threadIdx.x; i < ntok * a.ROPE; i += blockDim.x) {
      const int t = t_first + a.fd_rope.div(i);
      int64_t pp = a.pos64 ? static_cast<const int64_t*>(a.pos)[t] : static_cast<const int32_t*>(a.pos)[t];
      pp = pp < 0 ? 0 : (pp >= a.max_pos ? a.max_pos - 1 : pp);
      sh[i] = a.cos_sin[pp * a.ROPE + (i - (t - t_first) * a.ROPE)];
    }
    cs.sh = sh;
  }
  return cs;
}

}  // namespace
