// Query gather CUDA kernels (see query/direct.cu), part 3: the flag-in-data push protocols, where every
// line of finished rows carries the call's flag (no fence, no ready flag) - LL (consume; its publish is
// the unit-item path's kPubPeersLL store), the sentinel push SN (no flag at all: the data replaces a rest
// pattern; consume, its publish is the kPubPeersSN store; SN16 publish and consume), LL12 (publish and consume
// of 8-byte output words in triples) and LL128 (its own kernel).
#pragma once

#include "params.cuh"
#include "unit_items.cuh"  // the SN16 publish goes through the unit-item path's loads and conversion

namespace {

// Poll one round of a thread's kUnroll items until each is taken - `take(k)` loads item k's lines and, once
// they carry the call's flag, copies it out and returns true - against the call's one deadline (`t0`: 0 until
// the first miss). On expiry it records the first missing item's peer and returns true: the caller stops
// polling (one timeout bounds the whole call) and leaves the missing rows (the host raises).
template <typename Take>
__device__ __forceinline__ bool poll_round(const Params& a, bool (&need)[kUnroll], const int (&peer)[kUnroll],
                                           uint32_t f, uint64_t& t0, Take take) {
  while (true) {
    bool pending = false;
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (!need[k]) continue;
      if (take(k)) {
        need[k] = false;
      } else {
        pending = true;
      }
    }
    if (!pending) return false;
    if (t0 == 0) t0 = globaltimer();
    if ((int64_t)(globaltimer() - t0) > a.timeout_ns) {
      for (int k = 0; k < kUnroll; ++k) {
        if (need[k]) {
          record_timeout(a, peer[k], (int64_t)f);
          break;
        }
      }
      return true;
    }
  }
}

// The consumer loop of the polled push protocols (LL, SN, LL12): items [0, n) of every peer's rows in our area,
// kUnroll per thread per round, every load in flight. `locate(idx, src, dst)` sets item idx's address in our
// area and its output byte offset and returns its peer; `take(src, dst)` loads the item once and, if it is
// there, copies it out and returns true. One deadline for the whole call (poll_round).
template <typename Src, typename Locate, typename Take>
__device__ __forceinline__ void poll_items(const Params& a, int n, uint32_t f, Locate locate, Take take) {
  uint64_t t0 = 0;
  bool expired = false;
  for (int base = threadIdx.x; base < n && !expired; base += kThreads * kUnroll) {
    Src src[kUnroll];
    int64_t dst[kUnroll];
    int peer[kUnroll];
    bool need[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      const int idx = base + k * kThreads;
      need[k] = idx < n;
      if (need[k]) peer[k] = locate(idx, src[k], dst[k]);
    }
    expired = poll_round(a, need, peer, f, t0, [&](int k) { return take(src[k], dst[k]); });
  }
}

// PUSH_LL consume: the peers' lines of units [u0, u1) from our LL area (parity `par`) into the output at
// widened heads s*H + h, 8 output bytes per 16-byte line, each taken once both of its flags equal `f`.
// Each thread polls its own lines (kUnroll at a time, all in flight) against one deadline for the whole
// call; on timeout it records the error once and leaves the missing rows (the host raises).
__device__ void copy_rows_ll(const Params& a, int u0, int u1, int par, uint32_t f, int osize) {
  const int64_t row_bytes = (int64_t)(a.NOPE + a.ROPE) * osize;
  const int nq = a.fd_w8.d;  // lines per row: row_bytes / 8
  const int per_src = (u1 - u0) * nq;
  poll_items<const uint4*>(
      a, (a.W - 1) * per_src, f,
      [&](int idx, const uint4*& src, int64_t& dst) {
        int rem;
        const int s = peer_of(a, idx, per_src, &rem);
        const int du = a.fd_w8.div(rem), u = u0 + du, q = rem - du * nq, t = a.fd_h.div(u), h = u - t * a.H;
        src = reinterpret_cast<const uint4*>(reinterpret_cast<const char*>(a.peers.base[a.rank]) +
                                            ll_region(a, par, s, osize)) + (int64_t)u * nq + q;
        dst = ((int64_t)t * a.HOUT + s * a.H + h) * row_bytes + 8 * (int64_t)q;
        return s;
      },
      [&](const uint4* src, int64_t dst) {
        const uint4 w = peerdcp::ld_volatile_v4(src);
        if (w.y != f || w.w != f) return false;
        *reinterpret_cast<uint2*>(static_cast<char*>(a.out) + dst) = make_uint2(w.x, w.z);
        return true;
      });
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

// ------------------------------------------------------------------------------------ PUSH_SN
// The sentinel push: the LL push's publish and work split, but every 8 output bytes travel as they are - one
// single-copy-atomic 8-byte store (st.volatile.u64; BF16: two in one st.volatile.v2.u64) into our region of
// every peer's sentinel area - instead of a 16-byte line that is half flags. The area's rest state is kSnRest in every word (the
// host fills it before any peer can publish); a consumer takes a word once it differs from kSnRest, copies
// it out and puts kSnRest back, so the area is at rest again after every call (no flag, no epoch in the data).
//
// Slot reuse: two parity areas, as LL (query/direct.cu): a rank writes a peer's parity area k in call e + 2
// only after its own call e + 1 finished, which needed words of that peer's call e + 1, issued after the
// peer's call e - whose consumers read area k and restored it - completed (stream order: the restores are
// performed before the peer's next kernel starts). A word is restored only after its new value was seen, so a
// restore never erases a word of the call being read. A call that timed out leaves the words that never came
// at rest and restores the others.
//
// kW 8-byte words per item: 1 (FP8 SN) or 2 (FP8 SN16 and BF16 SN: one ld.volatile.v2.u64 - each half is
// single-copy atomic, not the pair, so a pair is taken once neither half is at rest).
template <int kW>
__device__ void copy_rows_sn(const Params& a, int u0, int u1, int par, uint32_t f, int osize) {
  const FastDiv& fq = kW == 1 ? a.fd_w8 : a.fd_w16;
  const int nq = fq.d;  // items per row: D * osize / (8 * kW)
  const int per_src = (u1 - u0) * nq;
  char* const area = reinterpret_cast<char*>(a.peers.base[a.rank]);
  poll_items<uint64_t*>(
      a, (a.W - 1) * per_src, f,
      [&](int idx, uint64_t*& src, int64_t& dst) {
        int rem;
        const int s = peer_of(a, idx, per_src, &rem);
        const int du = fq.div(rem), u = u0 + du, q = rem - du * nq, t = a.fd_h.div(u), h = u - t * a.H;
        src = reinterpret_cast<uint64_t*>(area + sn_region(a, par, s, osize)) + kW * ((int64_t)u * nq + q);
        dst = ((int64_t)t * a.HOUT + s * a.H + h) * nq * 8 * kW + 8 * kW * (int64_t)q;
        return s;
      },
      [&](uint64_t* src, int64_t dst_off) {
        char* const dst = static_cast<char*>(a.out) + dst_off;
        if constexpr (kW == 1) {
          const uint64_t w = peerdcp::ld_volatile_u64(src);
          if (w == kSnRest) return false;
          *reinterpret_cast<uint64_t*>(dst) = w;
          *src = kSnRest;  // back at rest for the call e + 2 that reuses this parity area
        } else {
          uint64_t x, y;
          peerdcp::ld_volatile_v2u64(src, x, y);
          if (x == kSnRest || y == kSnRest) return false;
          *reinterpret_cast<uint4*>(dst) =
              make_uint4((uint32_t)x, (uint32_t)(x >> 32), (uint32_t)y, (uint32_t)(y >> 32));
          *reinterpret_cast<uint4*>(src) = make_uint4(~0u, ~0u, ~0u, ~0u);  // back at rest
        }
        return true;
      });
}

// SN16 (kPushSN with the kModeWide bit; interleaved RoPE only): the same area, rest state and slot argument,
// but a thread publishes two neighbouring items (output words 2i, 2i + 1 of a row: 16 bytes) with one
// st.volatile.v2.u64 - each 8-byte element is single-copy atomic, not the pair, so the consumer takes a pair
// once neither half is at rest. Fewer, wider NVLink stores: faster for large calls, slower for small ones
// (longer per-thread chains: 10.89 vs 11.35 us at T = 128, 3.55 vs 3.32 at T = 1).
constexpr int kU16 = 2;  // pairs per thread per round (4 input vectors in flight, as kUnroll)

__device__ void publish_sn16(const Params& a, const CosSin& cs, int u0, int u1, const Sources& own, const Pub& pub) {
  const int ipu = items_per_unit<false>(a);  // even: NOPE / 8 and ROPE / 8 are
  const int np = (u1 - u0) * ipu / 2;
  const int64_t D = a.NOPE + a.ROPE;
  for (int base = threadIdx.x; base < np; base += kThreads * kU16) {
    Item it[kU16][2];
#pragma unroll
    for (int k = 0; k < kU16; ++k) {
      const int idx = base + k * kThreads;
      it[k][0].j = -1;
      if (idx < np) {
        load_item<false, false>(it[k][0], a, own, u0, u1, 2 * idx);
        load_item<false, false>(it[k][1], a, own, u0, u1, 2 * idx + 1);
      }
    }
#pragma unroll
    for (int k = 0; k < kU16; ++k) {
      if (it[k][0].j < 0) continue;
      const uint2 w0 = item_fp8_interleaved(it[k][0], a, cs), w1 = item_fp8_interleaved(it[k][1], a, cs);
      const int t = it[k][0].t, h = it[k][0].h, j = it[k][0].j;
      char* orow = static_cast<char*>(out_row(a, t, a.rank * a.H + h, 1));
      *reinterpret_cast<uint4*>(orow + 8 * j) = make_uint4(w0.x, w0.y, w1.x, w1.y);
      const int64_t mine = sn_region(a, pub.slot, a.rank, 1) + ((int64_t)t * a.H + h) * D + 8 * j;
      const uint64_t s0 = sn_word(w0), s1 = sn_word(w1);
      for (int i = 1; i < a.W; ++i)
        peerdcp::st_volatile_v2u64(peer_word(a, i, mine), s0, s1);
    }
  }
}

// ------------------------------------------------------------------------------------ PUSH_LL12
// LL12 (the LL push with denser lines): every 12 output bytes travel with their flag in one 16-byte line
// {3 data words, flag} (st.volatile.v4) instead of LL's {data, flag, data, flag}: 3/4 of the line is data
// (LL: 1/2). A thread converts 3 consecutive 8-byte output words (24 bytes: two lines) of a source's rows and
// the consumer takes the pair once both lines' flags match. Same area, flag, work split and two-parity
// argument as LL (query/direct.cu); the rows of a unit hold a multiple of 3 words (the host checks D * osize % 24).
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
  const int du = a.fd_w8.div(lw), u = u0 + du, t = a.fd_h.div(u);  // wpr = D * osize / 8
  return {t, u - t * a.H, lw - du * wpr};
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
        uint4* d = reinterpret_cast<uint4*>(reinterpret_cast<char*>(a.peers.base[rank_after(a, i)]) + mine) + 2 * idx;
        // (weak 16-byte stores measured the same)
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
  char* const out = static_cast<char*>(a.out);
  const char* area = reinterpret_cast<const char*>(a.peers.base[a.rank]) + (int64_t)u0 * wpr / kTriple * 32;
  poll_items<const uint4*>(
      a, (a.W - 1) * per_src, f,
      [&](int idx, const uint4*& src, int64_t& dst) {
        int li;  // triple within this block's units
        const int s = peer_of(a, idx, per_src, &li);
        src = reinterpret_cast<const uint4*>(area + ll12_region(a, par, s, osize)) + 2 * li;
        dst = out_off(a, s, unit_word(a, u0, kTriple * li, wpr), osize);
        return s;
      },
      [&](const uint4* src, int64_t dst) {
        const uint4 l0 = peerdcp::ld_volatile_v4(src);
        const uint4 l1 = peerdcp::ld_volatile_v4(src + 1);
        if (l0.w != f || l1.w != f) return false;
        uint2* o = reinterpret_cast<uint2*>(out + dst);
        o[0] = make_uint2(l0.x, l0.y);
        o[1] = make_uint2(l0.z, l1.x);
        o[2] = make_uint2(l1.y, l1.z);
        return true;
      });
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
// NVLink Hopper; csrc/output/direct.cu's LL128 kernel makes it too): a 128-byte-aligned line written by 8
// lanes of one warp store instruction is seen whole by a reader's 8-lane load of that line, never torn.
// Every line store here is that one instruction (the flag enters by a select, a line's 8 lanes are valid
// or invalid together). A torn line shows up as wrong bytes in the graph-replay tests with changing inputs.
//
// Work split: the NL = ceil(PW / 15) lines of a call are divided evenly over the NPROG blocks, the same on
// every rank; block p publishes its lines of our rows to every peer and copies out the same lines of every
// peer's rows. Area (at ll128_off): [2 parity][W src][ll128_lines] lines. Two parities suffice by the LL
// argument (query/direct.cu), which is about whole grids, not blocks (the line split changes with T): a rank writes
// a peer's parity area k in call e + 2 only after its own call e + 1 finished, which needed lines of that
// peer's call e + 1, which the peer issues after its call e - the last reader of area k - completed (stream
// order). fv = 2e + 1 differs from the value of call e - 2 (the area's previous use) and from zero.
//
// MEASURED (2 x H200, bench.query, 32 heads/rank, graph): correct (byte-identical
// matrix, 10,000 graph replays with changing inputs on vmm and symm, back-to-back mixing every exchange,
// missing peer -> PeerTimeoutError), but a fixed ~6.4 us at T = 1 (LL: 3.5, plain push: 5.0) and ~190 GB/s
// of payload at the margin (plain push ~270), with weak and with volatile line stores alike - the same
// fixed cost as csrc/output/direct.cu's LL128 kernel, cause not found: not the PDL overlap (without PDL:
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
        *(reinterpret_cast<uint4*>(dst) + lane) = line;  // weak: st.volatile measured the same
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

}  // namespace
