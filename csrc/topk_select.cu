// peerdcp Top-K: one rank's local canonical candidates in CUDA C++ (the GPU path of `_local_keys` in
// peerdcp/topk/selector.py, whose Triton `_keys_kernel` + torch.topk / torch.sort it replaces; read those first:
// same inputs, same output, bit for bit).
//
// Row t of `logits [T, Lmax]` fp32 holds this rank's scores of local rows l < nloc (nloc = the rank's share of
// the row's global length, see reference.local_length); local row l is global token
// g = (l / I) * W * I + rank * I + l % I. The canonical key of (score s, g) is
// ordered(s) << 31 | (2^31 - 1 - g) (reference.pack_keys: -0 == +0, NaN lowest), +inf scores for forced tokens.
// Keys are unique and >= 1, so "the n largest keys, descending" is one well-defined list; the output row is that
// list (n = min(topk, Lmax)) with -1 past the row's valid keys.
//
// One CTA per row, computing keys on the fly from the scores (no key array in global memory):
//   1. Radix select (rows of more than kBuf valid keys): a histogram of the next kBits bits of every key that
//      matches the prefix P found so far (starting with the top bits) gives the bin b holding the n-th largest
//      key; P grows by b, until the keys above P plus the keys equal to P fit in kBuf shared-memory slots. Each
//      level reads the row's scores once (L2 for a row that was just written; random scores need one or two
//      levels, heavy ties up to six, as the 31 id bits then decide).
//   2. Gather: every key whose prefix is >= P (the n - need keys above, and every candidate of bin b) into
//      shared memory, warp-aggregated slot claims.
//   3. A bitonic sort of those <= kBuf keys, descending, in shared memory; the first n (or all valid) are stored.
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>

#include <cstdint>

namespace {

constexpr int kThreads = 1024;
constexpr int kBuf = 4096;   // keys the final sort holds (32 KiB); rows of <= kBuf valid keys skip step 1
constexpr int kMaxN = 2048;  // largest n = min(topk, Lmax): a level may stop with up to kBuf - n + 1 candidates
constexpr int kBits = 11, kBins = 1 << kBits;
constexpr int kUnroll = 8;  // scores each thread has in flight per step (memory-level parallelism)

struct SelectParams {
  int64_t* out;          // [T, n] int64 keys, descending, -1 tail
  const float* logits;   // row t at logits + t * logits_stride
  int64_t logits_stride;
  const void* seq_lens;  // [T] int32 or int64 global lengths
  int lens64;
  int Lmax, n, rank, W, I;
  int64_t force_first, force_last;
};

__device__ __forceinline__ int64_t canonical_key(uint32_t bits, int64_t g) {
  // bitwise, so no flush-to-zero (this library builds with --use_fast_math) can merge a denormal with zero
  if ((bits & 0x7fffffffu) == 0) bits = 0;  // -0 == +0
  int64_t o;
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    o = 0;  // NaN ranks below -inf
  else
    o = (bits & 0x80000000u) ? static_cast<int64_t>(bits ^ 0xffffffffu) : static_cast<int64_t>(bits ^ 0x80000000u);
  return (o << 31) | (2147483647LL - g);
}

struct Row {
  const float* x;
  int64_t L, ff, fl;
  int rank, W, I;
  __device__ __forceinline__ int64_t key(float s, int l) const {
    const int64_t g = I == 1 ? static_cast<int64_t>(l) * W + rank
                             : static_cast<int64_t>(l / I) * W * I + static_cast<int64_t>(rank) * I + l % I;
    uint32_t bits = __float_as_uint(s);
    if (g < ff || g >= L - fl) bits = 0x7f800000u;  // forced: +inf
    return canonical_key(bits, g);
  }
};

// Calls f(key) for every valid local row (l < nloc), warp-uniformly: every lane of a warp makes the same number
// of calls, `in` false for lanes past the row's end (so f may use warp votes).
template <typename F>
__device__ __forceinline__ void for_each_key(const Row& row, int nloc, F f) {
  for (int base = 0; base < nloc; base += kThreads * kUnroll) {
    float v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int l = base + u * kThreads + static_cast<int>(threadIdx.x);
      v[u] = l < nloc ? __ldg(row.x + l) : 0.0f;
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int l = base + u * kThreads + static_cast<int>(threadIdx.x);
      const bool in = l < nloc;
      f(in, in ? row.key(v[u], l) : int64_t{0});
    }
  }
}

__global__ void __launch_bounds__(kThreads) topk_select_kernel(const SelectParams a) {
  using Scan = cub::BlockScan<int, kThreads>;
  __shared__ int64_t buf[kBuf];
  __shared__ int hist[kBins];
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ int count_sh, bin_sh, above_sh;
  const int t = blockIdx.x, tid = threadIdx.x, lane = tid & 31;
  const int64_t L = a.lens64 ? static_cast<const int64_t*>(a.seq_lens)[t] : static_cast<const int32_t*>(a.seq_lens)[t];
  // this rank's tokens among 0 .. L-1 (reference.local_length), at most the row's width
  const int64_t IW = static_cast<int64_t>(a.I) * a.W;
  int64_t rem = (L > 0 ? L % IW : 0) - static_cast<int64_t>(a.rank) * a.I;
  rem = rem < 0 ? 0 : (rem > a.I ? a.I : rem);
  int64_t nl = L > 0 ? (L / IW) * a.I + rem : 0;
  const int nloc = static_cast<int>(nl < a.Lmax ? nl : a.Lmax);
  const Row row{a.logits + static_cast<int64_t>(t) * a.logits_stride, L, a.force_first, a.force_last,
                a.rank, a.W, a.I};
  const int n = a.n;

  // ---- 1. radix select: afterwards the keys with (key >> shift) > P number n - need < n, and the keys with
  // (key >> shift) == P hold the need largest remaining ones; all of them fit in buf
  uint64_t P = 0;
  int shift = 63;  // keys are < 2^63: key >> 63 == 0 == P for every key
  int need = n;
  if (nloc > kBuf) {
    while (true) {
      const int width = shift < kBits ? shift : kBits, lo = shift - width;
      const uint64_t mask = (1ull << width) - 1;
      for (int i = tid; i < kBins; i += kThreads) hist[i] = 0;
      __syncthreads();
      for_each_key(row, nloc, [&](bool in, int64_t k) {
        const uint64_t u = static_cast<uint64_t>(k);
        const bool match = in && (u >> shift) == P;
        const unsigned act = __ballot_sync(0xffffffffu, match);
        if (match) {
          const int d = static_cast<int>((u >> lo) & mask);
          const unsigned peers = __match_any_sync(act, d);  // heavy ties: one shared atomic per bin per warp
          if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
        }
      });
      __syncthreads();
      // thread i owns bins hi = kBins-1-2i and hi-1; `above` = keys in bins above hi (descending scan)
      const int hi = kBins - 1 - 2 * tid;
      const int h1 = hist[hi], h0 = hist[hi - 1];
      int above;
      Scan(scan_tmp).ExclusiveSum(h1 + h0, above);
      if (above < need && need <= above + h1) {
        bin_sh = hi, above_sh = above;
      } else if (above + h1 < need && need <= above + h1 + h0) {
        bin_sh = hi - 1, above_sh = above + h1;
      }
      __syncthreads();
      const int b = bin_sh;
      need -= above_sh;
      P = (P << width) | static_cast<uint64_t>(b);
      shift = lo;
      const int cand = hist[b];
      __syncthreads();  // every thread read hist / bin_sh before the next level rewrites them
      if ((n - need) + cand <= kBuf || shift == 0) break;
    }
  }

  // ---- 2. gather every key with prefix >= P (all valid keys when step 1 did not run)
  if (tid == 0) count_sh = 0;
  __syncthreads();
  for_each_key(row, nloc, [&](bool in, int64_t k) {
    const bool take = in && (static_cast<uint64_t>(k) >> shift) >= P;
    const unsigned m = __ballot_sync(0xffffffffu, take);
    int base = 0;
    if (lane == 0 && m) base = atomicAdd(&count_sh, __popc(m));
    base = __shfl_sync(0xffffffffu, base, 0);
    if (take) buf[base + __popc(m & ((1u << lane) - 1))] = k;
  });
  __syncthreads();
  const int count = count_sh;

  // ---- 3. bitonic sort of buf[0, size), descending; padding 0 sorts below every key (keys are >= 1)
  int size = 2;
  while (size < count) size <<= 1;
  for (int i = count + tid; i < size; i += kThreads) buf[i] = 0;
  __syncthreads();
  for (int k = 2; k <= size; k <<= 1) {
    for (int j = k >> 1; j > 0; j >>= 1) {
      for (int i = tid; i < size; i += kThreads) {
        const int p = i ^ j;
        if (p > i) {
          const int64_t x = buf[i], y = buf[p];
          if (((i & k) == 0) ? (x < y) : (x > y)) buf[i] = y, buf[p] = x;
        }
      }
      __syncthreads();
    }
  }
  int64_t* out = a.out + static_cast<int64_t>(t) * n;
  const int valid = count < n ? count : n;
  for (int i = tid; i < n; i += kThreads) out[i] = i < valid ? buf[i] : -1;
}

}  // namespace

// Local canonical candidates of T rows into out [T, n] (contiguous int64), n = min(topk, Lmax) in [1, kMaxN].
// Returns a CUDA error code (0 = launched).
extern "C" int peerdcp_topk_select(int64_t* out, const float* logits, int64_t logits_stride, const void* seq_lens,
                                   int lens64, int Lmax, int n, int T, int rank, int W, int I, int64_t force_first,
                                   int64_t force_last, cudaStream_t stream) {
  if (n < 1 || n > kMaxN || Lmax < 1 || T < 0 || W < 1 || I < 1 || rank < 0 || rank >= W)
    return static_cast<int>(cudaErrorInvalidValue);
  if (T == 0) return 0;
  SelectParams a;
  a.out = out, a.logits = logits, a.logits_stride = logits_stride, a.seq_lens = seq_lens, a.lens64 = lens64;
  a.Lmax = Lmax, a.n = n, a.rank = rank, a.W = W, a.I = I, a.force_first = force_first, a.force_last = force_last;
  topk_select_kernel<<<T, kThreads, 0, stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

// Largest n the kernel selects (the host takes torch.topk above it).
extern "C" int peerdcp_topk_select_max_n() { return kMaxN; }
