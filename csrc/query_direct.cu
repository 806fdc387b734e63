// peerdcp Query gather: the consumer-direct kernel in CUDA C++ (the twin of peerdcp/query/kernels.py).
//
// Same protocol, buffer layout, work split and rounding as the Triton kernel (read its module docstring
// first): NPROG blocks on every rank, block p owns units [p*ceil(T*H/NPROG), ...) of every source shard
// and only waits for the flags of its twin block p on the peers; a per-block call counter epochs[p] in
// local memory picks the parity slot, so back-to-back calls and graph replays need no host sync.
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
// PUSH_LL12 (mode 6; below, before the kernel prologue): PUSH_LL with lines {3 data words, flag}, 3/4 data.
// PUSH_LL128 (mode 5; query_push_ll128_kernel): lines of 128 bytes, 15 data words and a flag word.
// The host picks among LL, LL12, LL128 and the fenced PUSH by the call's bytes (peerdcp.query.gather.TUNING).
//
// PDL (programmatic dependent launch, `mode | kModePdl`; the host sets it for T <= 32 by default, where it
// measured faster - it measured slower at T >= 64, session 5): the launch
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
#include <cuda_bf16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "common.cuh"

namespace {

constexpr int kMaxW = 8;
constexpr int kThreads = 256;
constexpr int kUnroll = 4;
constexpr int kMaxTok = 8;     // cos/sin rows cached in shared memory per block
constexpr int kMaxRope = 256;  // rope dims the shared cache holds
constexpr int kRaw = 0, kRoped = 1, kExposed = 2, kPush = 3, kPushLL = 4, kPushLL128 = 5, kPushLL12 = 6;
constexpr int kSlotZ = 2;
// Where a publish also writes each converted row: nowhere, our own slot (ROPED), our region of every
// peer's slot (PUSH), our region of every peer's LL area (PUSH_LL).
constexpr int kPubNone = 0, kPubOwn = 1, kPubPeers = 2, kPubPeersLL = 3;
constexpr int kModePdl = 8;     // `mode` bit: launch with programmatic dependent launch (see the header)
constexpr int kModeEarly = 16;  // `mode` bit: PUSH_LL loads its first round of inputs before the barrier
constexpr int kModeBits = kModePdl | kModeEarly;

struct Peers {
  uint64_t base[kMaxW];
};

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
  int early;                      // PUSH_LL: load the first round of inputs before the epoch / cos-sin barrier
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
// fields. (Until session 7 this claimed "set" first by an atomicCAS_system on the pinned host word.)
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

// Where the bf16 rows of a pass come from: one explicit source (this rank's tensors or slot), or every
// peer's slot (raw layout), skipping peers whose wait timed out.
struct Sources {
  const uint16_t* nope;  // single source: row (t, h) at nope + t*n_st + h*n_sh
  const uint16_t* pe;
  int64_t n_st, n_sh, p_st, p_sh;
  int src_rank;     // single source: the rank whose widened heads these are
  int count;        // 1 (single) or W - 1 (peers)
  int slot;         // peers: the slot to read
  const int* ok;    // peers: ok[s] == 0 -> skip rank s
};

// One work item of a unit, loaded: a 16-byte vector of the nope part, or of the rope part (NeoX: the
// two vectors holding pair members i and i + ROPE/2).
struct Item {
  uint4 a, b;
  int t, h, j, s;  // token, head, item index within the unit (< 0: none), source rank
};

template <bool NEOX>
__device__ __forceinline__ int items_per_unit(const Params& a) {
  return a.NOPE / 8 + (NEOX ? a.ROPE / 16 : a.ROPE / 8);
}

// Load item `idx` of the pass over units [u0, u1) of every source (the source is the slowest index, so
// neighbouring threads read neighbouring bytes of one source).
template <bool NEOX, bool CG>
__device__ __forceinline__ void load_item(Item& it, const Params& a, const Sources& src, int u0, int u1, int idx) {
  const int ipu = items_per_unit<NEOX>(a);
  const int per_src = (u1 - u0) * ipu;
  const int i = idx / per_src, rem = idx % per_src;
  const int u = u0 + rem / ipu;
  it.j = rem % ipu;
  it.t = u / a.H;
  it.h = u % a.H;
  const uint16_t *nope, *pe;
  if (src.ok == nullptr) {
    it.s = src.src_rank;
    nope = src.nope + it.t * src.n_st + it.h * src.n_sh;
    pe = src.pe + it.t * src.p_st + it.h * src.p_sh;
  } else {
    it.s = (a.rank + 1 + i) % a.W;
    if (!src.ok[it.s]) {
      it.j = -1;  // timed out: leave its rows, the host raises PeerTimeoutError
      return;
    }
    const char* base = slot_of(a, it.s, src.slot);
    const int64_t row = (int64_t)it.t * a.H + it.h;
    nope = reinterpret_cast<const uint16_t*>(base) + row * a.NOPE;
    pe = reinterpret_cast<const uint16_t*>(base + a.max_tokens * a.H * (int64_t)a.NOPE * 2) + row * a.ROPE;
  }
  const int nv = a.NOPE / 8;
  if (it.j < nv) {
    const uint4* p = reinterpret_cast<const uint4*>(nope) + it.j;
    it.a = CG ? ld_cg(p) : *p;
  } else {
    const uint4* p = reinterpret_cast<const uint4*>(pe);
    const int c = it.j - nv;
    it.a = CG ? ld_cg(p + c) : p[c];
    if (NEOX) it.b = CG ? ld_cg(p + c + a.ROPE / 16) : p[c + a.ROPE / 16];
  }
}

// Store one converted vector at byte `off` of output row `d1`, and (PUB) of the same unit's row in our own
// slot or in our region of every peer's slot (`row_off`: the unit's row offset in bytes there).
template <int PUB, typename V>
__device__ __forceinline__ void put(const Params& a, void* d1, int64_t row_off, const Pub& pub, int64_t off,
                                    const V& v) {
  constexpr int osize = sizeof(V) == 8 ? 1 : 2;  // a uint2 holds 8 FP8 codes, a uint4 8 bf16 values
  *reinterpret_cast<V*>(static_cast<char*>(d1) + off) = v;
  if constexpr (PUB == kPubOwn) *reinterpret_cast<V*>(slot_of(a, a.rank, pub.slot) + row_off + off) = v;
  if constexpr (PUB == kPubPeers) {
    const int64_t mine = (int64_t)a.rank * push_region(a, osize) + row_off + off;
    for (int i = 1; i < a.W; ++i) *reinterpret_cast<V*>(slot_of(a, (a.rank + i) % a.W, pub.slot) + mine) = v;
  }
  if constexpr (PUB == kPubPeersLL) {  // 8 output bytes -> one 16-byte LL line (twice for a uint4)
    const int64_t mine = ll_region(a, pub.slot, a.rank, osize) + 2 * (row_off + off);
    for (int i = 1; i < a.W; ++i) {
      uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.peers.base[(a.rank + i) % a.W]) + mine);
      peerdcp::st_volatile_v4(d, v.x, pub.f, v.y, pub.f);
      if constexpr (osize == 2) peerdcp::st_volatile_v4(d + 1, v.z, pub.f, v.w, pub.f);
    }
  }
}

// Convert 8 values and store them at element `off` of the row(s) (FP8: a uint2, bf16: a uint4).
template <bool FP8, int PUB>
__device__ __forceinline__ void store8x(const Params& a, void* d1, int64_t row_off, const Pub& pub, int64_t off,
                                        const float f[8]) {
  if constexpr (FP8) {
    put<PUB>(a, d1, row_off, pub, off, to_fp8x8(f, a.quant_scale));
  } else {
    put<PUB>(a, d1, row_off, pub, 2 * off, to_bf16x8(f));
  }
}

// Interleaved RoPE of rope item c of token t: elements 8c .. 8c+7 = pairs i = 4c .. 4c+3, (x[2i], x[2i+1]).
__device__ __forceinline__ void rotate_interleaved(const Item& it, const Params& a, const CosSin& cs, int c,
                                                   float y[8]) {
  const float* row = cs.row(a, it.t);
  float x[8];
  bf16x8(it.a, x);
  const float4 c4 = *reinterpret_cast<const float4*>(row + 4 * c);
  const float4 s4 = *reinterpret_cast<const float4*>(row + a.ROPE / 2 + 4 * c);
  const float cc[4] = {c4.x, c4.y, c4.z, c4.w}, ss[4] = {s4.x, s4.y, s4.z, s4.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    y[2 * i] = rot0(x[2 * i], x[2 * i + 1], cc[i], ss[i]);
    y[2 * i + 1] = rot1(x[2 * i], x[2 * i + 1], cc[i], ss[i]);
  }
}

// Interleaved RoPE, FP8: a loaded item -> its 8 output codes (the nope vector scaled, or the rotated rope
// vector), which land at byte 8 * it.j of the row.
__device__ __forceinline__ uint2 item_fp8_interleaved(const Item& it, const Params& a, const CosSin& cs) {
  const int nv = a.NOPE / 8;
  float y[8];
  if (it.j < nv) {
    bf16x8(it.a, y);
  } else {
    rotate_interleaved(it, a, cs, it.j - nv, y);
  }
  return to_fp8x8(y, a.quant_scale);
}

// Rotate / convert a loaded item and store it into row `dst_row` (and, PUB, the publish rows; `row_off`
// and `pub` locate them, see put()).
template <bool NEOX, bool FP8, int PUB>
__device__ __forceinline__ void emit_item(const Item& it, const Params& a, const CosSin& cs, void* dst_row,
                                          int64_t row_off, const Pub& pub) {
  const int nv = a.NOPE / 8;
  if constexpr (FP8 && !NEOX) {
    put<PUB>(a, dst_row, row_off, pub, 8 * (int64_t)it.j, item_fp8_interleaved(it, a, cs));
    return;
  }
  if (it.j < nv) {
    if constexpr (FP8) {
      float f[8];
      bf16x8(it.a, f);
      store8x<true, PUB>(a, dst_row, row_off, pub, (int64_t)it.j * 8, f);
    } else {
      put<PUB>(a, dst_row, row_off, pub, 16 * (int64_t)it.j, it.a);  // bf16 nope passes through
    }
    return;
  }
  const int c = it.j - nv;
  if constexpr (!NEOX) {
    float y[8];
    rotate_interleaved(it, a, cs, c, y);
    store8x<FP8, PUB>(a, dst_row, row_off, pub, a.NOPE + 8 * c, y);
  } else {
    const float* row = cs.row(a, it.t);
    const int half = a.ROPE / 2;
    // elements 8c .. 8c+7 (x0) pair with half + 8c .. (x1): i = 8c .. 8c+7
    float x0[8], x1[8], y0[8], y1[8];
    bf16x8(it.a, x0);
    bf16x8(it.b, x1);
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const float cv = row[8 * c + i], sv = row[half + 8 * c + i];
      y0[i] = rot0(x0[i], x1[i], cv, sv);
      y1[i] = rot1(x0[i], x1[i], cv, sv);
    }
    store8x<FP8, PUB>(a, dst_row, row_off, pub, a.NOPE + 8 * c, y0);
    store8x<FP8, PUB>(a, dst_row, row_off, pub, a.NOPE + half + 8 * c, y1);
  }
}

__device__ __forceinline__ void* out_row(const Params& a, int t, int widened_head, int osize) {
  return static_cast<char*>(a.out) + ((int64_t)t * a.HOUT + widened_head) * (int64_t)(a.NOPE + a.ROPE) * osize;
}

// Emit one loaded round (kUnroll items per thread; items with j < 0 are skipped): rotate/convert each into
// the output and, PUB, into the publish rows of `pub`.
template <bool NEOX, bool FP8, int PUB>
__device__ __forceinline__ void emit_round(const Params& a, const CosSin& cs, const Item (&it)[kUnroll], const Pub& pub) {
  constexpr int osize = FP8 ? 1 : 2;
  const int D = a.NOPE + a.ROPE;
#pragma unroll
  for (int k = 0; k < kUnroll; ++k) {
    if (it[k].j < 0) continue;
    const int64_t row_off = ((int64_t)it[k].t * a.H + it[k].h) * D * osize;
    emit_item<NEOX, FP8, PUB>(it[k], a, cs, out_row(a, it[k].t, it[k].s * a.H + it[k].h, osize), row_off, pub);
  }
}

// Rotate/convert units [u0, u1) of every source into the output (and, PUB, into the publish rows of
// `pub`: ROPED our own slot, PUSH our region of every peer's slot, PUSH_LL of every peer's LL area),
// from item `start` on (the items before it were emitted by the caller: see the PUSH_LL early load).
template <bool NEOX, bool FP8, bool CG, int PUB>
__device__ void compute_units(const Params& a, const CosSin& cs, int u0, int u1, const Sources& src, const Pub& pub,
                              int start = 0) {
  const int n = src.count * (u1 - u0) * items_per_unit<NEOX>(a);
  for (int base = start + threadIdx.x; base < n; base += kThreads * kUnroll) {
    Item it[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      it[k].j = -1;
      if (idx < n) load_item<NEOX, CG>(it[k], a, src, u0, u1, idx);
    }
    emit_round<NEOX, FP8, PUB>(a, cs, it, pub);
  }
}

// ROPED / PUSH consume: copy the finished rows (D * osize bytes, unit-major) of units [u0, u1) of every
// peer s into the output at widened heads s*H + h - ROPED from s's slot, PUSH from s's region of our slot.
template <bool PUSH>
__device__ void copy_rows(const Params& a, int u0, int u1, int slot, const int* ok, int osize) {
  const int64_t row_bytes = (int64_t)(a.NOPE + a.ROPE) * osize;
  const int vec = (int)(row_bytes / 16);
  const int per_src = (u1 - u0) * vec;
  const int n = (a.W - 1) * per_src;
  for (int base = threadIdx.x; base < n; base += kThreads * kUnroll) {
    uint4 v[kUnroll];
    int64_t dst_off[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      const int s = (a.rank + 1 + idx / per_src) % a.W;
      valid[k] = idx < n && ok[s];
      if (!valid[k]) continue;
      const int rem = idx % per_src;
      const int u = u0 + rem / vec, j = rem % vec, t = u / a.H, h = u % a.H;
      const char* src = PUSH ? slot_of(a, a.rank, slot) + s * push_region(a, osize) : slot_of(a, s, slot);
      v[k] = ld_cg(reinterpret_cast<const uint4*>(src + ((int64_t)t * a.H + h) * row_bytes) + j);
      dst_off[k] = ((int64_t)t * a.HOUT + s * a.H + h) * row_bytes + 16 * (int64_t)j;
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (valid[k]) *reinterpret_cast<uint4*>(static_cast<char*>(a.out) + dst_off[k]) = v[k];
    }
  }
}

// PUSH_LL consume: the peers' lines of units [u0, u1) from our LL area (parity `par`) into the output at
// widened heads s*H + h, 8 output bytes per 16-byte line, each taken once both of its flags equal `f`.
// Each thread polls its own lines (kUnroll at a time, all in flight) against one deadline for the whole
// call; on timeout it records the error once and leaves the missing rows (the host raises).
__device__ void copy_rows_ll(const Params& a, int u0, int u1, int par, uint32_t f, int osize) {
  const int64_t row_bytes = (int64_t)(a.NOPE + a.ROPE) * osize;
  const int nq = (int)(row_bytes / 8);  // lines per row
  const int per_src = (u1 - u0) * nq;
  const int n = (a.W - 1) * per_src;
  uint64_t t0 = 0;
  bool expired = false;
  for (int base = threadIdx.x; base < n && !expired; base += kThreads * kUnroll) {
    const uint4* src[kUnroll];
    int64_t dst_off[kUnroll];
    int peer[kUnroll];
    bool need[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      need[k] = idx < n;
      if (!need[k]) continue;
      const int s = (a.rank + 1 + idx / per_src) % a.W;
      const int rem = idx % per_src;
      const int u = u0 + rem / nq, q = rem % nq, t = u / a.H, h = u % a.H;
      src[k] = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.peers.base[a.rank]) +
                                              ll_region(a, par, s, osize)) + (int64_t)u * nq + q;
      dst_off[k] = ((int64_t)t * a.HOUT + s * a.H + h) * row_bytes + 8 * (int64_t)q;
      peer[k] = s;
    }
    while (true) {
      bool pending = false;
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (!need[k]) continue;
        const uint4 w = peerdcp::ld_volatile_v4(src[k]);
        if (w.y == f && w.w == f) {
          *reinterpret_cast<uint2*>(static_cast<char*>(a.out) + dst_off[k]) = make_uint2(w.x, w.z);
          need[k] = false;
        } else {
          pending = true;
        }
      }
      if (!pending) break;
      if (t0 == 0) t0 = globaltimer();
      if ((int64_t)(globaltimer() - t0) > a.timeout_ns) {
        for (int k = 0; k < kUnroll; ++k) {
          if (need[k]) {
            record_timeout(a, peer[k], (int64_t)f);
            break;
          }
        }
        expired = true;  // stop polling: one timeout bounds the whole call
        break;
      }
    }
  }
}

// RAW publish item idx of units [u0, ...): a 16-byte vector of the caller's nope or pe row, and its byte
// offset in the raw slot (nope region [max_tokens, H, NOPE], then pe region [max_tokens, H, ROPE]).
__device__ __forceinline__ const uint4* raw_item(const Params& a, int u0, int idx, int64_t pe_region_bytes,
                                                 int64_t& dst_off) {
  const int nv = a.NOPE / 8, ipu = nv + a.ROPE / 8;
  const int u = u0 + idx / ipu, j = idx % ipu, t = u / a.H, h = u % a.H;
  const int64_t row = (int64_t)t * a.H + h;
  if (j < nv) {
    dst_off = row * a.NOPE * 2 + 16 * (int64_t)j;
    return reinterpret_cast<const uint4*>(a.q_nope + t * a.s_nt + h * a.s_nh) + j;
  }
  dst_off = pe_region_bytes + row * a.ROPE * 2 + 16 * (int64_t)(j - nv);
  return reinterpret_cast<const uint4*>(a.q_pe + t * a.s_pt + h * a.s_ph) + (j - nv);
}

// One 8-byte output word of a source's rows, loaded: word j of unit (t, h) holds E = 8 / osize output
// values, from E bf16 inputs (FP8: 16 bytes in `a`; BF16: 8 bytes in a.x, a.y; NeoX rope: the partner
// half's values in `b`).
struct WordIn {
  uint4 a, b;
  int t, h, j;
};

template <bool NEOX, bool FP8>
__device__ __forceinline__ void load_word_at(WordIn& in, const Params& a, int t, int h, int j) {
  constexpr int E = FP8 ? 8 : 4;
  in.t = t;
  in.h = h;
  in.j = j;
  const int nw = a.NOPE / E;
  const uint16_t* p0;
  const uint16_t* p1 = nullptr;
  if (in.j < nw) {
    p0 = a.q_nope + in.t * a.s_nt + in.h * a.s_nh + E * in.j;
  } else {
    const uint16_t* pe = a.q_pe + in.t * a.s_pt + in.h * a.s_ph;
    const int pos = E * (in.j - nw), half = a.ROPE / 2;
    p0 = pe + pos;
    if (NEOX) {  // pair (i, i + half): x0 = pe[i], x1 = pe[i + half]
      if (pos < half) {
        p1 = pe + pos + half;
      } else {
        p0 = pe + pos - half;
        p1 = pe + pos;
      }
    }
  }
  if constexpr (FP8) {
    in.a = *reinterpret_cast<const uint4*>(p0);
    if (NEOX && p1 != nullptr) in.b = *reinterpret_cast<const uint4*>(p1);
  } else {
    const uint2 v = *reinterpret_cast<const uint2*>(p0);
    in.a = make_uint4(v.x, v.y, 0, 0);
    if (NEOX && p1 != nullptr) {
      const uint2 v1 = *reinterpret_cast<const uint2*>(p1);
      in.b = make_uint4(v1.x, v1.y, 0, 0);
    }
  }
}

// load_word_at of word w of a source's rows (unit-major, D * osize / 8 words per unit).
template <bool NEOX, bool FP8>
__device__ __forceinline__ void load_word(WordIn& in, const Params& a, int64_t w) {
  constexpr int E = FP8 ? 8 : 4;
  const int wpr = (a.NOPE + a.ROPE) / E;
  const int64_t u = w / wpr;
  const int t = (int)(u / a.H);
  load_word_at<NEOX, FP8>(in, a, t, (int)(u - (int64_t)t * a.H), (int)(w - u * wpr));
}

// The loaded word -> its 8 output bytes, with the same operations (and so the same bits) as emit_item.
template <bool NEOX, bool FP8>
__device__ __forceinline__ uint2 finish_word(const WordIn& in, const Params& a, const CosSin& cs) {
  constexpr int E = FP8 ? 8 : 4;
  const int nw = a.NOPE / E;
  float x[8], x1[8], y[8];
  bf16x8(in.a, x);  // (BF16: elements 4..7 unused)
  if (in.j < nw) {
    if constexpr (!FP8) return make_uint2(in.a.x, in.a.y);  // bf16 nope passes through
    return to_fp8x8(x, a.quant_scale);
  }
  const float* row = cs.row(a, in.t);
  const int pos = E * (in.j - nw), half = a.ROPE / 2;
  if constexpr (!NEOX) {
#pragma unroll
    for (int i = 0; i < E / 2; ++i) {  // pairs (2k, 2k + 1), k = pos / 2 + i
      const float c = row[pos / 2 + i], s = row[half + pos / 2 + i];
      y[2 * i] = rot0(x[2 * i], x[2 * i + 1], c, s);
      y[2 * i + 1] = rot1(x[2 * i], x[2 * i + 1], c, s);
    }
  } else {
    bf16x8(in.b, x1);
    const bool first = pos < half;  // first half: x0 * c - x1 * s; second: x0 * s + x1 * c
    const int k0 = first ? pos : pos - half;
#pragma unroll
    for (int i = 0; i < E; ++i) {
      const float c = row[k0 + i], s = row[half + k0 + i];
      y[i] = first ? rot0(x[i], x1[i], c, s) : rot1(x[i], x1[i], c, s);
    }
  }
  if constexpr (FP8) {
    return to_fp8x8(y, a.quant_scale);
  } else {
    const uint4 v = to_bf16x8(y);  // elements 0..3 in v.x, v.y
    return make_uint2(v.x, v.y);
  }
}

// Byte offset in `out` of output word w of source s (unit-major words, wpr per row).
__device__ __forceinline__ int64_t out_word_off(const Params& a, int s, int64_t w, int wpr) {
  const int64_t u = w / wpr;
  const int64_t t = u / a.H, h = u - t * a.H;
  return ((t * a.HOUT + s * a.H + h) * wpr + (w - u * wpr)) * 8;
}

// ------------------------------------------------------------------------------------ PUSH_LL12
// LL12 (the LL push with denser lines): every 12 output bytes travel with their flag in one 16-byte line
// {3 data words, flag} (st.volatile.v4) instead of LL's {data, flag, data, flag}: 3/4 of the line is data
// (LL: 1/2). A thread converts 3 consecutive 8-byte output words (24 bytes: two lines) of a source's rows and
// the consumer takes the pair once both lines' flags match. Same area, flag, work split and two-parity
// argument as LL (header); the rows of a unit hold a multiple of 3 words (the host checks D * osize % 24).
//
// ASSUMPTION (not in the PTX memory model, which makes only each 8-byte element of a vector access
// single-copy atomic): an aligned 16-byte store of one thread is seen whole by an aligned 16-byte load. It is
// implied by the assumption NCCL's LL128 protocol (and this file's LL128 kernel) makes for whole 128-byte
// lines written by 8 lanes of one instruction - every line store here is part of such a warp store. A torn
// line shows up as wrong bytes in the graph-replay tests with changing inputs.
constexpr int kTriple = 3;  // 8-byte output words per thread item (two 16-byte lines)

__device__ __forceinline__ int64_t ll12_region(const Params& a, int par, int src, int osize) {
  const int64_t triples = a.ll_max_tokens * a.H * (int64_t)(a.NOPE + a.ROPE) * osize / (8 * kTriple);
  return a.ll_off + (int64_t)(par * a.W + src) * triples * 32;
}

constexpr int kU12 = 2;  // triples per thread per round, every load in flight (4: register spills)

// Word j of the row of unit u, as (token, head, word).
struct UnitWord {
  int t, h, j;
};
__device__ __forceinline__ UnitWord unit_word(const Params& a, int u0, int lw, int wpr) {
  const int u = u0 + lw / wpr;
  return {u / a.H, u % a.H, lw % wpr};
}
__device__ __forceinline__ int64_t out_off(const Params& a, int s, const UnitWord& x, int osize) {
  return ((int64_t)x.t * a.HOUT + s * a.H + x.h) * (int64_t)(a.NOPE + a.ROPE) * osize + 8 * (int64_t)x.j;
}

// PUSH_LL12 publish: units [u0, u1) of our rows, triple by triple (a triple never spans two rows), to our
// output and into our region of every peer's LL area (two lines per triple).
template <bool NEOX, bool FP8>
__device__ void publish_ll12(const Params& a, const CosSin& cs, int u0, int u1, int par, uint32_t f) {
  constexpr int osize = FP8 ? 1 : 2;
  const int wpr = (a.NOPE + a.ROPE) * osize / 8;
  const int n = (u1 - u0) * wpr / kTriple;
  const int64_t mine = ll12_region(a, par, a.rank, osize) + (int64_t)u0 * wpr / kTriple * 32;
  char* const out = static_cast<char*>(a.out);
  for (int base = threadIdx.x; base < n; base += kThreads * kU12) {
    WordIn in[kU12][kTriple];
#pragma unroll
    for (int k = 0; k < kU12; ++k) {
      const int idx = base + k * kThreads;
      if (idx >= n) continue;
      const UnitWord x = unit_word(a, u0, kTriple * idx, wpr);
#pragma unroll
      for (int q = 0; q < kTriple; ++q) load_word_at<NEOX, FP8>(in[k][q], a, x.t, x.h, x.j + q);
    }
#pragma unroll
    for (int k = 0; k < kU12; ++k) {
      const int idx = base + k * kThreads;
      if (idx >= n) continue;
      uint2 v[kTriple];
#pragma unroll
      for (int q = 0; q < kTriple; ++q) v[q] = finish_word<NEOX, FP8>(in[k][q], a, cs);
      const UnitWord x{in[k][0].t, in[k][0].h, in[k][0].j};
      uint2* o = reinterpret_cast<uint2*>(out + out_off(a, a.rank, x, osize));
#pragma unroll
      for (int q = 0; q < kTriple; ++q) o[q] = v[q];
      for (int i = 1; i < a.W; ++i) {
        uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.peers.base[(a.rank + i) % a.W]) + mine) + 2 * idx;
        // (weak 16-byte stores measured the same, session 7)
        peerdcp::st_volatile_v4(d, v[0].x, v[0].y, v[1].x, f);
        peerdcp::st_volatile_v4(d + 1, v[1].y, v[2].x, v[2].y, f);
      }
    }
  }
}

// PUSH_LL12 consume: every peer's triples of units [u0, u1) from our LL area into the output, each taken
// once both of its lines carry `f`; one deadline per call, as copy_rows_ll.
__device__ void copy_rows_ll12(const Params& a, int u0, int u1, int par, uint32_t f, int osize) {
  const int wpr = (a.NOPE + a.ROPE) * osize / 8;
  const int per_src = (u1 - u0) * wpr / kTriple;
  const int n = (a.W - 1) * per_src;
  char* const out = static_cast<char*>(a.out);
  const char* area = reinterpret_cast<const char*>(a.peers.base[a.rank]) + (int64_t)u0 * wpr / kTriple * 32;
  uint64_t t0 = 0;
  bool expired = false;
  for (int base = threadIdx.x; base < n && !expired; base += kThreads * kUnroll) {
    const uint4* src[kUnroll];
    int64_t dst[kUnroll];
    int peer[kUnroll];
    bool need[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      need[k] = idx < n;
      if (!need[k]) continue;
      peer[k] = (a.rank + 1 + idx / per_src) % a.W;
      const int li = idx % per_src;  // triple within this block's units
      src[k] = reinterpret_cast<const uint4*>(area + ll12_region(a, par, peer[k], osize)) + 2 * li;
      dst[k] = out_off(a, peer[k], unit_word(a, u0, kTriple * li, wpr), osize);
    }
    while (true) {
      bool pending = false;
#pragma unroll
      for (int k = 0; k < kUnroll; ++k) {
        if (!need[k]) continue;
        const uint4 l0 = peerdcp::ld_volatile_v4(src[k]);
        const uint4 l1 = peerdcp::ld_volatile_v4(src[k] + 1);
        if (l0.w == f && l1.w == f) {
          uint2* o = reinterpret_cast<uint2*>(out + dst[k]);
          o[0] = make_uint2(l0.x, l0.y);
          o[1] = make_uint2(l0.z, l1.x);
          o[2] = make_uint2(l1.y, l1.z);
          need[k] = false;
        } else {
          pending = true;
        }
      }
      if (!pending) break;
      if (t0 == 0) t0 = globaltimer();
      if ((int64_t)(globaltimer() - t0) > a.timeout_ns) {
        for (int k = 0; k < kUnroll; ++k) {
          if (need[k]) {
            record_timeout(a, peer[k], (int64_t)f);
            break;
          }
        }
        expired = true;  // stop polling: one timeout bounds the whole call
        break;
      }
    }
  }
}

// Kernel prologue, every block of every call: PDL wait (the previous grid is complete and visible) and
// trigger, then bump this block's call counter (only block p touches epochs[p]) into *e_sh.
__device__ __forceinline__ void enter_call(const Params& a, int p, int64_t* e_sh) {
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" :::);
  if (threadIdx.x == 0) {
    const int64_t e = a.epochs[p] + 1;
    a.epochs[p] = e;
    *e_sh = e;
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
      const int t = t_first + i / a.ROPE;
      int64_t pp = a.pos64 ? static_cast<const int64_t*>(a.pos)[t] : static_cast<const int32_t*>(a.pos)[t];
      pp = pp < 0 ? 0 : (pp >= a.max_pos ? a.max_pos - 1 : pp);
      sh[i] = a.cos_sin[pp * a.ROPE + i % a.ROPE];
    }
    cs.sh = sh;
  }
  return cs;
}

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
  const int upp = (n_units + a.nprog - 1) / a.nprog;
  const int u0 = p * upp;
  const int u1 = min(u0 + upp, n_units);
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
  // PUSH_LL with the early bit: the first round of this block's inputs is loaded before anything waits
  // (epoch, cos/sin), so those latencies overlap (the round is emitted after the barrier)
  const Sources own{a.q_nope, a.q_pe, a.s_nt, a.s_nh, a.s_pt, a.s_ph, a.rank, 1, 0, nullptr};
  Item early[kUnroll];
  if constexpr (MODE == kPushLL) {
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
  const CosSin cs = stage_cos_sin(a, u0 / H, (u1 - 1) / H, cs_sh);
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
    // slower at T >= 32, 2026-11-30 session 6)
    compute_units<NEOX, FP8, false, kPubPeers>(a, cs, u0, u1, own, pub);
  } else if constexpr (MODE == kPushLL) {
    // the flag travels inside every 8-byte word: no fence, no ready flag, no barrier
    if (a.early) {
      emit_round<NEOX, FP8, kPubPeersLL>(a, cs, early, pub);
      compute_units<NEOX, FP8, false, kPubPeersLL>(a, cs, u0, u1, own, pub, kThreads * kUnroll);
    } else {
      compute_units<NEOX, FP8, false, kPubPeersLL>(a, cs, u0, u1, own, pub);
    }
    if (W > 1) copy_rows_ll(a, u0, u1, par, pub.f, osize);
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

// ------------------------------------------------------------------------------------ PUSH_LL128
// Medium T (the host picks it for push calls above the LL bound and within the LL128 bound): the push
// publish with NCCL's LL128 protocol. A source's finished rows, taken as one sequence of 8-byte output
// words (PW = T * H * D * osize / 8 of them, unit-major as in a push region), travel as 128-byte lines of
// 15 data words + 1 flag word: lanes 8q .. 8q+7 of a warp store one line with one 16-byte store each,
// lane 7's upper half is the flag fv = 2e + 1 (64-bit). The consumer loads a line the same way (one 16-byte
// ld.volatile per lane) and takes it once lane 7 sees fv. No fence, no ready flag, 1/16 of the bytes are
// flags (LL: 1/2), and each line is copied out as soon as it is there.
//
// ASSUMPTION (not in the PTX memory model; NCCL's LL128 makes it and enables the protocol by default on
// NVLink Hopper; csrc/output_direct.cu's LL128 kernel makes it too): a 128-byte-aligned line written by 8
// lanes of one warp store instruction is seen whole by a reader's 8-lane load of that line, never torn.
// Every line store here is that one instruction (the flag enters by a select, a line's 8 lanes are valid
// or invalid together). A torn line shows up as wrong bytes in the graph-replay tests with changing inputs.
//
// Work split: the NL = ceil(PW / 15) lines of a call are divided evenly over the NPROG blocks, the same on
// every rank; block p publishes its lines of our rows to every peer and copies out the same lines of every
// peer's rows. Area (at ll128_off): [2 parity][W src][ll128_lines] lines. Two parities suffice by the LL
// argument (header), which is about whole grids, not blocks (the line split changes with T): a rank writes
// a peer's parity area k in call e + 2 only after its own call e + 1 finished, which needed lines of that
// peer's call e + 1, which the peer issues after its call e - the last reader of area k - completed (stream
// order). fv = 2e + 1 differs from the value of call e - 2 (the area's previous use) and from zero.
//
// MEASURED (2 x H200, bench.query, 32 heads/rank, graph, 2026-11-30 session 7): correct (byte-identical
// matrix, 10,000 graph replays with changing inputs on vmm and symm, back-to-back mixing every exchange,
// missing peer -> PeerTimeoutError), but a fixed ~6.4 us at T = 1 (LL: 3.5, plain push: 5.0) and ~190 GB/s
// of payload at the margin (plain push ~270), with weak and with volatile line stores alike - the same
// fixed cost as csrc/output_direct.cu's LL128 kernel, cause not found: not the PDL overlap (without PDL:
// 6.85 us) nor the two-blocks-per-SM occupancy (blocks of 128 threads: 6.22 us, slower at large T). It wins
// in a band only (FP8 12.68-12.80 us at T = 96 against 13.45-13.56 for the plain push and 14.90 for LL; BF16:
// never against roped), which is where the host uses it.
constexpr int kLineData = 15;                   // data words per 128-byte line (word 15 is the flag)
constexpr int kLineLanes = 8;                   // lanes per line, 16 bytes each
constexpr int kU128 = 4;                        // lines per 8-lane group per round, every load in flight
constexpr unsigned kFullMask = 0xffffffffu;

__device__ __forceinline__ int64_t ll128_region(const Params& a, int par, int src) {
  return a.ll128_off + (int64_t)(par * a.W + src) * a.ll128_lines * 128;
}

template <bool NEOX, bool FP8>
__global__ void __launch_bounds__(kThreads, 2) query_push_ll128_kernel(const Params a) {
  constexpr int osize = FP8 ? 1 : 2;
  constexpr int E = FP8 ? 8 : 4;
  __shared__ int64_t e_sh;
  __shared__ __align__(16) float cs_sh[kMaxTok * kMaxRope];
  const int p = blockIdx.x, tid = threadIdx.x, W = a.W, H = a.H;
  enter_call(a, p, &e_sh);
  zero_padding(a, p, osize);
  const int wpr = (a.NOPE + a.ROPE) / E;
  const int64_t pw = (int64_t)a.T * H * wpr;
  const int64_t nl = (pw + kLineData - 1) / kLineData;
  const int64_t lo = nl * p / a.nprog, hi = nl * (p + 1) / a.nprog;
  if (lo >= hi) return;  // after bumping the counter: every block counts every call
  const int64_t w_last = min(hi * kLineData, pw) - 1;
  const CosSin cs = stage_cos_sin(a, (int)(lo * kLineData / wpr / H), (int)(w_last / wpr / H), cs_sh);
  __syncthreads();
  const int64_t e = e_sh;
  const int par = (int)(e & 1);
  const uint64_t fv = 2 * (uint64_t)e + 1;
  const uint32_t flo = (uint32_t)fv, fhi = (uint32_t)(fv >> 32);
  const int lane = tid & (kLineLanes - 1), g = tid / kLineLanes;
  const int kGroups = blockDim.x / kLineLanes;  // lines the block handles per step
  const int n = (int)(hi - lo);  // lines of this block (per source)
  char* const out = static_cast<char*>(a.out);

  // ---- publish: words 15L + 2 lane (+1) of our rows, to our own output and into every peer's area
  const int64_t mine = ll128_region(a, par, a.rank);
  for (int base = 0; base < n; base += kGroups * kU128) {
    WordIn in[kU128][2];
    bool has[kU128][2];
#pragma unroll
    for (int k = 0; k < kU128; ++k) {
      const int64_t L = lo + base + k * kGroups + g;
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        const int64_t w = L * kLineData + 2 * lane + q;
        has[k][q] = L < hi && (q == 0 || lane < kLineLanes - 1) && w < pw;
        if (has[k][q]) load_word<NEOX, FP8>(in[k][q], a, w);
      }
    }
#pragma unroll
    for (int k = 0; k < kU128; ++k) {
      const int64_t L = lo + base + k * kGroups + g;
      if (L >= hi) continue;  // the same for the 8 lanes of the line
      uint2 x[2] = {make_uint2(0, 0), make_uint2(0, 0)};
#pragma unroll
      for (int q = 0; q < 2; ++q) {
        if (!has[k][q]) continue;
        x[q] = finish_word<NEOX, FP8>(in[k][q], a, cs);
        const int64_t w = L * kLineData + 2 * lane + q;
        *reinterpret_cast<uint2*>(out + out_word_off(a, a.rank, w, wpr)) = x[q];
      }
      // one 16-byte store per lane, one instruction per line; lane 7's upper half is the flag (a select)
      const bool fl = lane == kLineLanes - 1;
      const uint4 line = make_uint4(x[0].x, x[0].y, fl ? flo : x[1].x, fl ? fhi : x[1].y);
      for (int i = 1; i < W; ++i) {
        char* dst = reinterpret_cast<char*>(a.peers.base[(a.rank + i) % W]) + mine + L * 128;
        *(reinterpret_cast<uint4*>(dst) + lane) = line;  // weak: st.volatile measured the same (session 7)
      }
    }
  }

  // ---- consume: lines [lo, hi) of every peer's rows in our area, each copied out once lane 7 sees fv.
  // Warp-collective: a round issues every load first; lines not there yet are reloaded whole (never a mix
  // of two reads) until the warp's lines are all there, against one deadline per wait; a peer whose line
  // timed out is dead for this warp from then on (its rows stay as they are, the host raises).
  const int flag_lane = (tid & 31) | (kLineLanes - 1);
  const int n_items = (W - 1) * n;
  const char* area = reinterpret_cast<const char*>(a.peers.base[a.rank]);
  unsigned dead = 0;  // warp-uniform
  for (int base = 0; base < n_items; base += kGroups * kU128) {  // the same trip count for every thread
    uint4 v[kU128];
    const uint4* src[kU128];
    int s[kU128];
    int64_t L[kU128];
    bool live[kU128];
#pragma unroll
    for (int k = 0; k < kU128; ++k) {
      const int item = base + k * kGroups + g;
      live[k] = item < n_items;
      s[k] = live[k] ? (a.rank + 1 + item / n) % W : a.rank;
      L[k] = lo + (live[k] ? item % n : 0);
      live[k] = live[k] && !((dead >> s[k]) & 1u);
      src[k] = reinterpret_cast<const uint4*>(area + ll128_region(a, par, s[k]) + L[k] * 128) + lane;
      v[k] = live[k] ? peerdcp::ld_volatile_v4(src[k]) : make_uint4(0, 0, 0, 0);
    }
#pragma unroll
    for (int k = 0; k < kU128; ++k) {
      live[k] = live[k] && !((dead >> s[k]) & 1u);  // a peer that timed out earlier in this round
      bool rdy = __shfl_sync(kFullMask, !live[k] || (v[k].z == flo && v[k].w == fhi), flag_lane);
      if (!__all_sync(kFullMask, rdy)) {
        const uint64_t t0 = globaltimer();
        int spins = 0;
        while (true) {
          if (!rdy) v[k] = peerdcp::ld_volatile_v4(src[k]);  // the whole line again
          rdy = __shfl_sync(kFullMask, !live[k] || (v[k].z == flo && v[k].w == fhi), flag_lane);
          if (__all_sync(kFullMask, rdy)) break;
          if (++spins == 64) {
            spins = 0;
            const bool late = (int64_t)(globaltimer() - t0) > a.timeout_ns;
            if (__shfl_sync(kFullMask, late, 0)) break;
          }
        }
        const unsigned lost = __reduce_or_sync(kFullMask, rdy ? 0u : (1u << s[k]));
        if (lost != 0) {  // timed out: those peers are dead for this warp
          dead |= lost;
          if ((tid & 31) == 0) record_timeout(a, __ffs(lost) - 1, (int64_t)fv);
        }
      }
      if (!live[k] || !rdy) continue;
      const int64_t w = L[k] * kLineData + 2 * lane;
      if (w < pw) *reinterpret_cast<uint2*>(out + out_word_off(a, s[k], w, wpr)) = make_uint2(v[k].x, v[k].y);
      if (lane < kLineLanes - 1 && w + 1 < pw)
        *reinterpret_cast<uint2*>(out + out_word_off(a, s[k], w + 1, wpr)) = make_uint2(v[k].z, v[k].w);
    }
  }
}

__global__ void query_wait_acks_kernel(const Params a) {
  const int p = blockIdx.x, tid = threadIdx.x;
  const int64_t ez = a.last_z[p];
  if (ez == 0 || tid >= a.W || tid == a.rank) return;
  wait_flag(flags_of(a, a.rank) + 2 * (int64_t)a.nprog * a.W + (int64_t)p * a.W + tid, ez, a, tid);
}

cudaError_t launch_one(void (*kernel)(const Params), const Params& a, bool pdl, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(a.nprog);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
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

}  // namespace

extern "C" int peerdcp_query_direct(const void* q_nope, const void* q_pe, int64_t s_nt, int64_t s_nh, int64_t s_pt,
                                    int64_t s_ph, const void* pos, int pos64, const float* cos_sin, int64_t max_pos,
                                    void* out, const uint64_t* peer_addrs, int64_t* epochs, int64_t* last_z,
                                    void* err, int64_t timeout_ns, float quant_scale, int T, int rank, int W, int H,
                                    int HOUT, int NOPE, int ROPE, int64_t max_tokens, int64_t data_off,
                                    int64_t slot_bytes, int64_t ll_off, int64_t ll_max_tokens, int64_t ll128_off,
                                    int64_t ll128_lines, int nprog, int mode,
                                    int neox, int fp8, int mech, cudaStream_t stream) {
  if (W < 1 || W > kMaxW || NOPE % 16 || ROPE % 16 || nprog < 1) return (int)cudaErrorInvalidValue;
  Params a{};
  a.q_nope = static_cast<const uint16_t*>(q_nope);
  a.q_pe = static_cast<const uint16_t*>(q_pe);
  a.s_nt = s_nt, a.s_nh = s_nh, a.s_pt = s_pt, a.s_ph = s_ph;
  a.pos = pos, a.pos64 = pos64, a.cos_sin = cos_sin, a.max_pos = max_pos;
  a.out = out;
  for (int r = 0; r < W; ++r) a.peers.base[r] = peer_addrs[r];
  a.epochs = epochs, a.last_z = last_z;
  a.err = static_cast<unsigned long long*>(err);
  a.timeout_ns = timeout_ns, a.quant_scale = quant_scale;
  a.T = T, a.rank = rank, a.W = W, a.H = H, a.HOUT = HOUT, a.NOPE = NOPE, a.ROPE = ROPE;
  a.nprog = nprog, a.mech = mech;
  a.max_tokens = max_tokens, a.data_off = data_off, a.slot_bytes = slot_bytes;
  a.ll_off = ll_off, a.ll_max_tokens = ll_max_tokens;
  a.ll128_off = ll128_off, a.ll128_lines = ll128_lines;
  a.early = (mode & kModeEarly) != 0;
  if ((mode & kModeEarly) && (mode & ~kModeBits) != kPushLL) return (int)cudaErrorInvalidValue;
  if (T <= 0) return (int)cudaSuccess;
  const bool pdl = (mode & kModePdl) != 0;
  switch (mode & ~kModeBits) {
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

extern "C" int peerdcp_query_wait_acks(const uint64_t* peer_addrs, int64_t* last_z, void* err, int64_t timeout_ns,
                                       int rank, int W, int nprog, int mech, cudaStream_t stream) {
  if (W < 1 || W > kMaxW || nprog < 1) return (int)cudaErrorInvalidValue;
  Params a{};
  for (int r = 0; r < W; ++r) a.peers.base[r] = peer_addrs[r];
  a.last_z = last_z;
  a.err = static_cast<unsigned long long*>(err);
  a.timeout_ns = timeout_ns;
  a.rank = rank, a.W = W, a.nprog = nprog, a.mech = mech;
  query_wait_acks_kernel<<<nprog, 32, 0, stream>>>(a);
  return (int)cudaGetLastError();
}
