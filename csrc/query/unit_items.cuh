// Query gather CUDA kernels (see query/direct.cu), part 2: the unit-item path of the raw, roped, fenced push
// and exposed exchanges - a work item is one 16-byte vector of a (token, head) row, loaded, rotated /
// converted and stored into the output and the publish rows - and the consumers' copy of finished rows.
#pragma once

#include "params.cuh"

namespace {

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
  const FastDiv& ipu = a.fd_ipu[NEOX];
  const int per_src = (u1 - u0) * ipu.d;
  int i = 0, rem = idx;  // source i of the pass, item rem of its units (a single source: i = 0)
  // peer_of's loop, written out: calling peer_of here makes the raw kernel 0.5 us slower at T = 4 (2 x H200; the
  // other T and the exposed kernel unchanged), so the copy stays.
  if (src.ok != nullptr) {
    while (rem >= per_src) {
      rem -= per_src;
      ++i;
    }
  }
  const int du = ipu.div(rem);
  const int u = u0 + du;
  it.j = rem - du * ipu.d;
  it.t = a.fd_h.div(u);
  it.h = u - it.t * a.H;
  const uint16_t *nope, *pe;
  if (src.ok == nullptr) {
    it.s = src.src_rank;
    nope = src.nope + it.t * src.n_st + it.h * src.n_sh;
    pe = src.pe + it.t * src.p_st + it.h * src.p_sh;
  } else {
    it.s = rank_after(a, 1 + i);
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
    for (int i = 1; i < a.W; ++i) *reinterpret_cast<V*>(slot_of(a, rank_after(a, i), pub.slot) + mine) = v;
  }
  if constexpr (PUB == kPubPeersLL) {  // 8 output bytes -> one 16-byte LL line (twice for a uint4)
    const int64_t mine = ll_region(a, pub.slot, a.rank, osize) + 2 * (row_off + off);
    for (int i = 1; i < a.W; ++i) {
      uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.peers.base[rank_after(a, i)]) + mine);
      peerdcp::st_volatile_v4(d, v.x, pub.f, v.y, pub.f);
      if constexpr (osize == 2) peerdcp::st_volatile_v4(d + 1, v.z, pub.f, v.w, pub.f);
    }
  }
  if constexpr (PUB == kPubPeersSN) {  // single-copy-atomic 8-byte words off the rest state (query/flag_in_data.cuh)
    const int64_t mine = sn_region(a, pub.slot, a.rank, osize) + row_off + off;
    if constexpr (osize == 1) {  // 8 FP8 codes: one word
      const uint64_t w = sn_word(v);
      for (int i = 1; i < a.W; ++i) peerdcp::st_volatile_u64(peer_word(a, i, mine), w);
    } else {  // 8 bf16 values: two words in one 16-byte store (each word atomic, the consumer checks both)
      const uint64_t w0 = sn_word_bf16(v.x, v.y), w1 = sn_word_bf16(v.z, v.w);
      for (int i = 1; i < a.W; ++i) peerdcp::st_volatile_v2u64(peer_word(a, i, mine), w0, w1);
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

// The LL / SN publish of units [u0, u1): with the early bit the caller already loaded the first round
// (`early`, before the epoch / cos-sin barrier), which is emitted first, then the rest.
template <bool NEOX, bool FP8, int PUB>
__device__ __forceinline__ void publish_early(const Params& a, const CosSin& cs, int u0, int u1, const Sources& own,
                                              const Pub& pub, const Item (&early)[kUnroll]) {
  if (a.early) {
    emit_round<NEOX, FP8, PUB>(a, cs, early, pub);
    compute_units<NEOX, FP8, false, PUB>(a, cs, u0, u1, own, pub, kThreads * kUnroll);
  } else {
    compute_units<NEOX, FP8, false, PUB>(a, cs, u0, u1, own, pub);
  }
}

// ROPED / PUSH consume: copy the finished rows (D * osize bytes, unit-major) of units [u0, u1) of every
// peer s into the output at widened heads s*H + h - ROPED from s's slot, PUSH from s's region of our slot.
template <bool PUSH>
__device__ void copy_rows(const Params& a, int u0, int u1, int slot, const int* ok, int osize) {
  const int64_t row_bytes = (int64_t)(a.NOPE + a.ROPE) * osize;
  const int vec = a.fd_w16.d;  // row_bytes / 16
  const int per_src = (u1 - u0) * vec;
  const int n = (a.W - 1) * per_src;
  for (int base = threadIdx.x; base < n; base += kThreads * kUnroll) {
    uint4 v[kUnroll];
    int64_t dst_off[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      valid[k] = false;
      if (idx >= n) continue;
      int rem;
      const int s = peer_of(a, idx, per_src, &rem);
      valid[k] = ok[s];
      if (!valid[k]) continue;
      const int du = a.fd_w16.div(rem), u = u0 + du, j = rem - du * vec, t = a.fd_h.div(u), h = u - t * a.H;
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

// RAW publish item idx of units [u0, ...): a 16-byte vector of the caller's nope or pe row, and its byte
// offset in the raw slot (nope region [max_tokens, H, NOPE], then pe region [max_tokens, H, ROPE]).
__device__ __forceinline__ const uint4* raw_item(const Params& a, int u0, int idx, int64_t pe_region_bytes,
                                                 int64_t& dst_off) {
  const int nv = a.NOPE / 8;
  const int du = a.fd_ipu[0].div(idx), u = u0 + du, j = idx - du * a.fd_ipu[0].d, t = a.fd_h.div(u), h = u - t * a.H;
  const int64_t row = (int64_t)t * a.H + h;
  if (j < nv) {
    dst_off = row * a.NOPE * 2 + 16 * (int64_t)j;
    return reinterpret_cast<const uint4*>(a.q_nope + t * a.s_nt + h * a.s_nh) + j;
  }
  dst_off = pe_region_bytes + row * a.ROPE * 2 + 16 * (int64_t)(j - nv);
  return reinterpret_cast<const uint4*>(a.q_pe + t * a.s_pt + h * a.s_ph) + (j - nv);
}

}  // namespace
