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
// One CTA per row, or at few rows a thread-block cluster of C <= 8 CTAs per row (each reads a slice of the row;
// policy.select_ctas picks C from CUDA's cluster occupancy), computing keys on the fly from the scores (no key array
// in global memory):
//   1. Rows of more than kBuf valid keys: thresholds estimated from the score parts of 2048 evenly spaced rows (one
//      CTA per row: 4096 above 64K rows)
//      (about n + (kBuf - n) * f / 16 of the row's keys at or above them; sample_thresholds finds the samples of
//      those ranks through a histogram of the samples, not a sort), then one pass gathers
//      every key >= the middle threshold into shared memory; too many (> kBuf) or too few (< n) keys retry with
//      the next threshold up or down. When that fails (scores whose order correlates with the sample's spacing,
//      heavy ties), an exact radix select finds the prefix of the n-th key level by level (a histogram of the next
//      kBits bits per level, one pass each; heavy ties up to six) and a pass gathers the keys above it. Keys are
//      unique, so every gather takes exactly the keys above a threshold. A cluster sums its CTAs' counts and
//      histograms through distributed shared memory, so every CTA takes the same decisions.
//   2. A cluster: every CTA's gathered keys go into CTA 0's shared memory (distributed shared memory stores);
//      CTA 0 goes on alone, as one CTA per row does.
//   3. The n largest of the <= kBuf gathered keys, sorted, by buckets (bucket_top: buckets spread over the gathered
//      scores' range; the buckets that hold ranks < n are scattered in bucket order and a key's rank = its bucket's
//      start + the keys of its bucket above it); the first n (or every valid one) are stored, -1 after. Where a
//      bucket of the n largest would overflow, once more with buckets spread over the keys' bits (heavy tails).
//   4. Where that overflows too (few distinct scores, far outliers amid a dense bulk): an exact radix select
//      over the gathered keys keeps those above the n-th largest key's prefix (at most 2 * kThreads), then
//      sort_desc sorts them (per-warp bitonic networks in registers, then merge-path merges of sorted runs in
//      shared memory).
//   5. Optionally (TopK.select's direct path) the row is then published to the peers of the direct Top-K - its
//      epoch advanced, its keys stored into their inboxes, their flags released: publish_row, in place of the
//      separate publish kernel that merge() launches.
//
// Where the time goes (one H200; phase stamps of CTA 0: scripts/diag/select_phases.py; the tables: bench/RESULTS.md,
// Top-K local selection): the samples' histogram ends ~2.5 us after the kernel's start; one SM's gather pass over
// 128K scores takes ~27 us, bound by instructions per score (two float compares), not by loads; with the taken keys
// stored in one round per key one CTA selects one row of 128K in 32.0 us (39.6 with a block per score position),
// 128 rows of 128K in 43.4 (51.4). Bulk-copied steps in shared memory measured slower everywhere. A cluster of 8
// splits the gathers 8 ways (one row of 128K: 18.3 us).
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "peer_memory.cuh"

namespace {

constexpr int kThreads = 1024;
constexpr int kBuf = 4096;   // keys a gather holds (4 per thread); rows of <= kBuf valid keys take them all
constexpr int kMaxN = 2048;  // largest n = min(topk, Lmax)
constexpr int kMaxCluster = 8;  // most CTAs per row (the portable thread-block cluster size)
constexpr int kTries = 7;      // thresholds the estimate may try, for expected counts n + (kBuf - n) * kFrac / 16
__constant__ int kFrac[kTries] = {1, 3, 5, 8, 11, 13, 15};
constexpr int kBits = 11, kBins = 1 << kBits;
constexpr int kUnroll = 2;  // float4 loads each thread has in flight per step (4: register spills at 64)

#ifdef PEERDCP_SELECT_TRACE
// Diagnosis build only (scripts/diag/select_phases.py sets PEERDCP_NVCC_EXTRA=-DPEERDCP_SELECT_TRACE): CTA 0's
// thread 0 stamps %globaltimer at each phase boundary (words 0-7) and counts the estimate's gather passes (word 8)
// and bucket_top's retries by the keys' bits (word 9); peerdcp_topk_select_trace copies the 10 words out.
__device__ long long g_trace[10];
__device__ __forceinline__ void trace(int i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) {
    long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    if (i == 0)
      for (int j = 1; j < 10; ++j) g_trace[j] = 0;  // phases that do not run stay 0
    g_trace[i] = t;
  }
}
__device__ __forceinline__ void trace_count(int i) {
  if (blockIdx.x == 0 && threadIdx.x == 0) ++g_trace[i];
}
#else
__device__ __forceinline__ void trace(int) {}
__device__ __forceinline__ void trace_count(int) {}
#endif

struct SelectParams {
  int64_t* out;          // [T, n] int64 keys, descending, -1 tail
  const float* logits;   // row t at logits + t * logits_stride
  int64_t logits_stride;
  const void* seq_lens;  // [T] int32 or int64 global lengths
  int lens64;
  int Lmax, n, rank, W, I;
  int64_t force_first, force_last;
  int radix_only;  // 1: skip the estimate (tests and diagnosis run the radix select on every row)
  int C;           // CTAs per row: one thread-block cluster of C (1 to kMaxCluster) shares each row
  // The direct Top-K's publish step in the same kernel (peers == nullptr: none; peerdcp/topk/selector.py has the
  // protocol): once row t's keys are stored, its epoch e = ++state[1 + t], the keys padded to K with -1 go into
  // every peer's inbox [e % 2, rank, t, :] (word `inbox` of its buffer) and the peer's flag [e % 2, rank, t] = e.
  const int64_t* peers;  // [W] every rank's buffer base address in this process (int64 words: flags at 0)
  int64_t* state;        // [1 + max_rows] local: [aborted, epoch of row 0, ...]
  int64_t inbox;         // word offset of the inbox [2, W, max_rows, K] in a buffer
  int K, max_rows;
};

// ordered(s): the score's 32 canonical bits (reference.ordered_bits), bitwise, so no flush-to-zero (this library
// builds with --use_fast_math) can merge a denormal with zero
__device__ __forceinline__ uint32_t ordered_bits(uint32_t bits) {
  if ((bits & 0x7fffffffu) == 0) bits = 0;                // -0 == +0
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0;       // NaN ranks below -inf
  return (bits & 0x80000000u) ? bits ^ 0xffffffffu : bits ^ 0x80000000u;
}

struct Row {
  const float* x;
  int64_t L, ff, fl;
  int rank, W, I, nloc;
  int beg, end;  // this CTA's slice [beg, end) of the local rows (all of them with one CTA per row)
  bool forced;   // ff > 0 or fl > 0: some tokens score +inf
  __device__ __forceinline__ int64_t gid(int l) const {
    return I == 1 ? static_cast<int64_t>(l) * W + rank
                  : static_cast<int64_t>(l / I) * W * I + static_cast<int64_t>(rank) * I + l % I;
  }
  // the canonical key's score part of local row l with score s (forced tokens: +inf)
  __device__ __forceinline__ uint32_t ordered(float s, int l) const {
    uint32_t bits = __float_as_uint(s);
    if (forced) {
      const int64_t g = gid(l);
      if (g < ff || g >= L - fl) bits = 0x7f800000u;
    }
    return ordered_bits(bits);
  }
  // its id part: 2^31 - 1 - g (a larger id ranks lower)
  __device__ __forceinline__ int64_t id_part(int l) const { return 2147483647LL - gid(l); }
  __device__ __forceinline__ int64_t key(float s, int l) const {
    return (static_cast<int64_t>(ordered(s, l)) << 31) | id_part(l);
  }
};

constexpr int kPerStep = kUnroll * 4;          // scores each thread loads per step
constexpr int kStep = kThreads * kPerStep;     // scores the CTA loads per step

// Local row of a thread's e-th score of the step at `base` (VEC: four consecutive rows per 16-byte load).
template <bool VEC>
__device__ __forceinline__ int row_of(int base, int e) {
  const int tid = threadIdx.x;
  return VEC ? base + ((e >> 2) * kThreads + tid) * 4 + (e & 3) : base + e * kThreads + tid;
}

// The thread's kPerStep scores of the step at `base` (NaN from the CTA's slice end on, never read past it; a slice
// starts at a multiple of 4). VEC: 16-byte loads (rows 16-byte aligned).
template <bool VEC>
__device__ __forceinline__ void load_step(const Row& row, int base, float (&v)[kPerStep]) {
  if constexpr (VEC) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int l = row_of<true>(base, 4 * u);
      float4 q;
      if (l + 4 <= row.end) {
        q = __ldg(reinterpret_cast<const float4*>(row.x + l));
      } else {  // the slice's last partial vector: never read past its valid scores (nor the row's allocation)
        const float pad = __int_as_float(0x7fc00000);  // NaN
        q.x = l < row.end ? __ldg(row.x + l) : pad;
        q.y = l + 1 < row.end ? __ldg(row.x + l + 1) : pad;
        q.z = l + 2 < row.end ? __ldg(row.x + l + 2) : pad;
        q.w = pad;  // l + 3 >= end here
      }
      v[4 * u] = q.x, v[4 * u + 1] = q.y, v[4 * u + 2] = q.z, v[4 * u + 3] = q.w;
    }
  } else {
#pragma unroll
    for (int e = 0; e < kPerStep; ++e) {
      const int l = row_of<false>(base, e);
      v[e] = l < row.end ? __ldg(row.x + l) : __int_as_float(0x7fc00000);
    }
  }
}

// Sorts the N = R * kThreads keys of the CTA descending into buf[0, N): thread tid brings v[r] (any order). Each
// warp first sorts its 32 R keys in registers (a bitonic network: warp shuffles, and register swaps for partners
// 32 and 64 elements apart), then sorted runs are merged pairwise, log2(kThreads / 32) times, by merge path in
// shared memory (one buffer: every output is computed in registers before a barrier, then stored). K: int64_t
// canonical keys.
// NT: only threads tid < NT (whole warps) take part, N = R * NT (fewer keys, fewer merge levels: the levels'
// searches, not the networks, take most of the time); the others only meet the barriers.
template <int R, typename K, int NT = kThreads>
__device__ __forceinline__ void sort_desc(K (&v)[R], K* buf) {
  static_assert(NT % 32 == 0 && NT <= kThreads, "whole warps");
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const bool active = tid < NT;
  constexpr int kRun = 32 * R, N = R * NT;
  if (active) {
#pragma unroll
    for (int k = 2; k <= kRun; k <<= 1) {
#pragma unroll
      for (int j = k >> 1; j > 0; j >>= 1) {
        K o[R];  // every partner's old value first: partners in registers are both updated below
#pragma unroll
        for (int r = 0; r < R; ++r)
          o[r] = j >= 32 ? v[r ^ (j >> 5)] : __shfl_xor_sync(0xffffffffu, v[r], j);  // constant index once unrolled
#pragma unroll
        for (int r = 0; r < R; ++r) {
          const int e = r * 32 + lane;  // the key's index in the warp's run
          const bool keep_max = ((e & k) == 0) == ((e & j) == 0);  // descending block: the lower index keeps the max
          v[r] = keep_max ? (v[r] > o[r] ? v[r] : o[r]) : (v[r] < o[r] ? v[r] : o[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) buf[warp * kRun + r * 32 + lane] = v[r];
  }
  __syncthreads();
  // merge levels (merge path): thread tid makes outputs [tid * R, tid * R + R) of its pair of runs A (left) and
  // B (right): a binary search on its diagonal d finds how many of the first d outputs come from A, then R steps
  // of a sequential merge; A's key goes first among equals (equal keys: the padding zeros, tied score parts)
  for (int run = kRun; run < N; run <<= 1) {
    const int d0 = tid * R;
    K x[R];
    if (active) {
      const int pair = d0 / (2 * run), d = d0 - pair * 2 * run;
      const K* A = buf + pair * 2 * run;
      const K* B = A + run;
      int lo = d > run ? d - run : 0, hi = d < run ? d : run;
      while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (A[mid] >= B[d - 1 - mid])
          lo = mid + 1;
        else
          hi = mid;
      }
      int i = lo, j = d - lo;
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const K a = i < run ? A[i] : 0, b = j < run ? B[j] : 0;
        const bool from_a = j >= run || (i < run && a >= b);  // A first among equals, as in the search
        x[r] = from_a ? a : b;
        i += from_a ? 1 : 0;
        j += from_a ? 0 : 1;
      }
    }
    __syncthreads();  // every thread read its inputs before any output overwrites them
    if (active) {
#pragma unroll
      for (int r = 0; r < R; ++r) buf[d0 + r] = x[r];
    }
    __syncthreads();
  }
}

// buf[0, count) (count <= R * NT) sorted descending in place by threads tid < NT; padding 0 sorts below every key
// (keys >= 1).
template <int R, int NT = kThreads>
__device__ __forceinline__ void sort_gathered(int64_t* buf, int count) {
  int64_t v[R];
#pragma unroll
  for (int r = 0; r < R; ++r) v[r] = threadIdx.x < NT && r * NT + threadIdx.x < count ? buf[r * NT + threadIdx.x] : 0;
  __syncthreads();  // every key read before the sort rewrites buf
  sort_desc<R, int64_t, NT>(v, buf);
}

static_assert(kThreads == 32 * 32, "block_exclusive_sum: one warp sum per lane");

struct Shared {
  int64_t buf[kBuf];  // gathered keys (with C > 1 at the end: every CTA's, in CTA 0's); the sorts' exchange area
  int hist[kBins];
  int wsum[kThreads / 32];  // block_exclusive_sum: every warp's sum
  int count, bin, above, bin_count;
  int pub[2];                 // C > 1: this CTA's count of the last two gathers, read by its peers
  int counts[kMaxCluster];    // C > 1: every CTA's count of the last gather
  int64_t tau[kTries];  // the estimate's thresholds, highest first
  unsigned kmin[2], kmax[2];      // bucket_top: the finite keys' smallest / largest score part [0] and id part [1]
  int overflow;                   // bucket_top: a bucket of the n largest keys holds more than kMaxBucket
  int top_end;                    // bucket_top: the keys in the buckets that hold the n largest
  int overflow_by_bits;           // bucket_top<true>'s overflow (its own word: see bucket_top)
};

// The exclusive prefix sum over the CTA of every thread's x, in thread order. One barrier: every warp scans its
// lanes' values with shuffles and lane 31 stores the warp's sum; after the barrier every warp scans the 32 warp sums
// itself. Not CUB's raking scan: it has warp 0 add 32 partials serially twice between two barriers (0.58 us of
// bucket_top's 4.1 at rows of 4K), and its storage and registers cost the kernel spills: with this scan the
// selection is faster or equal at every measured shape (rows of 2K / 4K 0.25-0.4 us faster, 128 rows of 128K
// 1.0 us; CUB's warp-scans variant was 0.1-0.8 us slower than the raking one). Every
// thread of the CTA calls it; two calls need a barrier between them (wsum is rewritten).
__device__ __forceinline__ int block_exclusive_sum(int x, int* wsum) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  int incl = x;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) wsum[warp] = incl;
  __syncthreads();
  int w = wsum[lane];
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, w, o);
    if (lane >= o) w += y;
  }
  const int before = __shfl_sync(0xffffffffu, w, (warp + 31) & 31);  // the warps below this one (lane warp - 1)
  return (warp == 0 ? 0 : before) + incl - x;
}

// ordered(-inf) and ordered(+inf): the score parts between them are finite (0 below: NaN)
constexpr uint32_t kOrderedNegInf = 0x007fffffu, kOrderedPosInf = 0xff800000u;

// the score of a key's score part (ordered_bits inverted; NaN, which ranks lowest, as -inf)
__device__ __forceinline__ float score32(uint32_t o) {
  return o == 0 ? -__int_as_float(0x7f800000) : __uint_as_float((o & 0x80000000u) ? o ^ 0x80000000u : o ^ 0xffffffffu);
}

// mn[i] / mx[i] (each thread's) reduced over the CTA into lo[i] / hi[i], which thread 0 initialized (to ~0 and 0)
// before the call: one warp reduction instruction each, then 32-bit shared atomics (native; 64-bit ones are a
// compare-and-swap loop that 32 warps serialize: bucket_top's 64-bit key range that way cost 0.4-1.8 us per
// selection). Every thread of the CTA calls it (two barriers).
template <int N>
__device__ __forceinline__ void block_min_max(const unsigned (&mn)[N], const unsigned (&mx)[N], unsigned* lo,
                                              unsigned* hi) {
  unsigned a[N], b[N];
#pragma unroll
  for (int i = 0; i < N; ++i) a[i] = __reduce_min_sync(0xffffffffu, mn[i]), b[i] = __reduce_max_sync(0xffffffffu, mx[i]);
  __syncthreads();  // (the initial values are stored)
  if ((threadIdx.x & 31) == 0) {
#pragma unroll
    for (int i = 0; i < N; ++i) atomicMin(lo + i, a[i]), atomicMax(hi + i, b[i]);
  }
  __syncthreads();
}

// The bucket of an ordered value v (a 63-bit key, or with kShift = 0 a 32-bit score part) among kBins evenly spaced
// over [lo, hi], descending (0: the largest values): over their scores when that range is finite and positive, else
// over the values themselves; values outside [lo, hi] go to the end buckets. Monotone in v (fp32 subtraction,
// multiplication, flush-to-zero, saturating conversion and the clamp never reverse an order), so a value's bucket
// never precedes a smaller value's.
template <typename U, int kShift>
struct BucketMap {
  U lo;
  float f_lo, scale;
  bool by_score;
  // allow_score false: over the values (their bits) even where the scores' range is finite and positive
  __device__ __forceinline__ BucketMap(U lo_, U hi, bool allow_score = true) : lo(lo_) {
    f_lo = score32(static_cast<uint32_t>(lo >> kShift));
    const float f_range = score32(static_cast<uint32_t>(hi >> kShift)) - f_lo;
    scale = static_cast<float>(kBins) / f_range;
    by_score = allow_score && isfinite(f_lo) && f_range > 0.0f && isfinite(f_range) && isfinite(scale);
    if (!by_score) scale = static_cast<float>(kBins) / (static_cast<float>(hi - lo) + 1.0f);
  }
  __device__ __forceinline__ int operator()(U v) const {
    const float x = by_score ? (score32(static_cast<uint32_t>(v >> kShift)) - f_lo) * scale
                             : static_cast<float>(static_cast<int64_t>(v) - static_cast<int64_t>(lo)) * scale;
    int b = static_cast<int>(x);
    b = b < 0 ? 0 : (b > kBins - 1 ? kBins - 1 : b);
    return kBins - 1 - b;
  }
};

// hist[0, kBins) replaced by its exclusive prefix sums, each thread two bins: h / st, its bins' counts and starts.
// Every thread calls it; hist is read back only after the caller's next barrier.
__device__ __forceinline__ void scan_pairs(int* hist, Shared& sh, int (&h)[2], int (&st)[2]) {
  const int tid = threadIdx.x;
  h[0] = hist[2 * tid], h[1] = hist[2 * tid + 1];
  st[0] = block_exclusive_sum(h[0] + h[1], sh.wsum), st[1] = st[0] + h[0];
  hist[2 * tid] = st[0], hist[2 * tid + 1] = st[1];  // (each thread rewrites only the two bins it read)
}
// scan_pairs, then a barrier
__device__ __forceinline__ void scan_bins(int* hist, Shared& sh) {
  int h[2], st[2];
  scan_pairs(hist, sh, h, st);
  __syncthreads();
}
// The n largest of buf[0, count) (count <= kBuf unique keys >= 1), descending, stored to out[0, n) with -1 past
// count, by buckets: kBins buckets evenly spaced over the keys' finite scores [lowest, highest] (BucketMap; +inf
// scores in bucket 0, -inf and NaN in the last; over the keys themselves when no score is finite), a histogram with
// a slot per key, a scan for the buckets' starts (a bucket's start is the rank of its largest key), a scatter of the
// buckets that hold ranks < n into buf in bucket order, and each of their keys' rank = its bucket's start + the
// keys of its bucket above it. The map is monotone, so a key's bucket never precedes a smaller key's; ties and the
// id order are settled inside a bucket by whole-key compares. Scores spread over a range (the usual case) put one to
// a few keys in a bucket, so the selection of the n largest and their sort are the same few shared-memory passes
// (the radix trim to 2 * kThreads keys and a bucket sort of those took ~3.5 us each, the network and merges
// 9.6). kByBits: the buckets evenly spaced over the keys' bits instead - about the log of |score| - which
// spreads heavy tails (lognormal, Pareto, Cauchy-like scores put most keys in one bucket of the score map). When a
// bucket holding one of the n largest keys would hold more than kMaxBucket keys (bucket 0: more than kMaxTopBucket)
// it writes nothing (out and buf unchanged) and returns kBucketRetry where the map went by the scores (the caller
// then calls bucket_top<true>), else kBucketOverflow (few distinct scores, far outliers amid a dense bulk: the caller
// trims and runs sort_gathered). The second map is a second instance called only then, so the common path's code is
// that of the one map (the same map retried in a loop inside one instance cost 0.1-0.35 us at every normal
// shape).
// Every thread of the CTA calls it (it synchronizes). Out of line in both kernel instances: inlined it cost ~0.6 us
// at C = 8 even where it did not run, and the one-CTA gather 20 % at 128 rows - its registers.
// (With 32, heavy-tailed scores - a few far outliers stretching the range - overflowed on 75-100 % of rows of
// <= 4K keys and took the fallback, 2.4-2.7x the normal time; a bucket's rank loop costs about its size in
// compares per key, far less than the trim and the network sort up to a few hundred keys.)
constexpr int kMaxBucket = 128;
// bucket 0 takes every key of a +inf score (forced tokens: the first / last windows of a sequence, ranked among
// themselves by id): up to this many before the fallback (its rank loop is then ~kMaxTopBucket compares per key)
constexpr int kMaxTopBucket = 256;
static_assert(kMaxBucket <= kMaxTopBucket, "bucket_top's end bound: end <= last + kMaxTopBucket");
enum BucketResult { kBucketDone, kBucketRetry, kBucketOverflow };
template <bool kByBits>
__device__ __noinline__ BucketResult bucket_top(int64_t* buf, int count, int n, int64_t* out, Shared& sh) {
  constexpr int R = kBuf / kThreads;
  const int tid = threadIdx.x;
  if (count == 0) {
    for (int i = tid; i < n; i += kThreads) out[i] = -1;
    return kBucketDone;
  }
  int* start = sh.hist;
  // the range: the keys of finite scores (+inf scores - forced tokens - go to bucket 0, -inf and NaN to the last)
  constexpr uint64_t kNegInfKey = (static_cast<uint64_t>(kOrderedNegInf) << 31) | 0x7fffffffull;  // its largest key
  constexpr uint64_t kPosInfKey = static_cast<uint64_t>(kOrderedPosInf) << 31;                    // its smallest
  // lo / hi: the finite keys' smallest / largest score part with their parts' smallest / largest id part: lo <= every
  // finite key <= hi, the exact extremes when all share one score (the map then goes by the keys), the exact score
  // parts otherwise (all the map uses when it goes by the scores)
  uint64_t k[R];
  unsigned mn[2] = {~0u, ~0u}, mx[2] = {0u, 0u};
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int i = r * kThreads + tid;
    k[r] = i < count ? static_cast<uint64_t>(buf[i]) : 0;  // (0: no key)
    if (k[r] > kNegInfKey && k[r] < kPosInfKey) {
      const unsigned sp = static_cast<unsigned>(k[r] >> 31), ip = static_cast<unsigned>(k[r] & 0x7fffffffu);
      mn[0] = sp < mn[0] ? sp : mn[0], mx[0] = sp > mx[0] ? sp : mx[0];
      mn[1] = ip < mn[1] ? ip : mn[1], mx[1] = ip > mx[1] ? ip : mx[1];
    }
  }
  // bucket_top<true> runs right after bucket_top<false> returned kBucketRetry, without a barrier between: a warp
  // still to read sh.overflow after the first call's last barrier must not see the second call's reset of it
  int& overflow = kByBits ? sh.overflow_by_bits : sh.overflow;
  if (tid == 0) sh.kmin[0] = sh.kmin[1] = ~0u, sh.kmax[0] = sh.kmax[1] = 0, overflow = 0;
  for (int i = tid; i < kBins; i += kThreads) start[i] = 0;
  block_min_max<2>(mn, mx, sh.kmin, sh.kmax);  // (its barriers: every key read, start zeroed)
  const bool finite = sh.kmin[0] <= sh.kmax[0];  // (none: by the keys over their whole range)
  const uint64_t lo = (static_cast<uint64_t>(sh.kmin[0]) << 31) | sh.kmin[1];
  const uint64_t hi = (static_cast<uint64_t>(sh.kmax[0]) << 31) | sh.kmax[1];
  const BucketMap<uint64_t, 31> bucket(finite ? lo : 0ull, finite ? hi : ~0ull >> 1, !kByBits);
  int bs[R] = {};  // a key's bucket | its slot in the bucket << 16 (kBins, kBuf <= 2^16)
#pragma unroll
  for (int r = 0; r < R; ++r) {
    if (k[r]) {
      const int b = bucket(k[r]);
      bs[r] = b | atomicAdd(&start[b], 1) << 16;
    }
  }
  __syncthreads();
  const int last = (count < n ? count : n) - 1;  // the rank of the last key stored
  {
    int h[2], st[2];
    scan_pairs(start, sh, h, st);
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      if (h[e] > 0 && st[e] <= last) {  // a bucket that holds ranks <= last
        if (h[e] > (2 * tid + e == 0 ? kMaxTopBucket : kMaxBucket)) overflow = 1;
        if (last < st[e] + h[e]) sh.top_end = st[e] + h[e];  // (one bucket holds rank `last`)
      }
    }
  }
  __syncthreads();
  // (the same in every thread; nothing written)
  if (overflow) return bucket.by_score ? kBucketRetry : kBucketOverflow;
  const int end = sh.top_end;  // the keys of the buckets scattered: buf[0, end), end <= last + kMaxTopBucket
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (k[r] && start[bs[r] & 0xffff] <= last) buf[start[bs[r] & 0xffff] + (bs[r] >> 16)] = static_cast<int64_t>(k[r]);
  __syncthreads();
  // ranks from bucket order: neighbouring threads take neighbouring keys, mostly of one bucket (broadcast reads)
  for (int p = tid; p < end; p += kThreads) {
    const uint64_t key = static_cast<uint64_t>(buf[p]);
    const int bk = bucket(key), e = bk + 1 < kBins ? start[bk + 1] : count;
    int rank = start[bk];
    for (int q = start[bk]; q < e; ++q) rank += static_cast<uint64_t>(buf[q]) > key ? 1 : 0;
    if (rank < n) out[rank] = static_cast<int64_t>(key);
  }
  for (int i = last + 1 + tid; i < n; i += kThreads) out[i] = -1;  // rows of fewer than n keys
  return kBucketDone;
}

// The estimate's thresholds sh.tau[0, kTries), highest first: for an expected count want_f = n + (kBuf - n) * f / 16
// of the row's keys at or above it (f = kFrac), the score part of the sample of rank q_f = want_f * kSamples / nloc
// - 1 among kSamples evenly spaced local rows - approximately: the samples go into kBins buckets spread evenly over
// a range of their finite scores that a few far outliers do not stretch (below; infinities, NaN and the samples
// outside it clamped to the end buckets), and the threshold is the smallest sample of the
// bucket holding rank q_f, so at most that bucket's other samples (one or two, unless the scores tie) more than the
// exact rank. A histogram, a scan and a binary search per threshold instead of sorting the samples (the sort of 2048
// took ~4.5 us). Every key of that score part or above passes the threshold: without the id part it
// cannot split tied scores, which only the radix select's fallback then costs. buf: kBins + 64 words of scratch.
// Every thread of the CTA calls it (it synchronizes); every CTA of a cluster computes the same thresholds.
// R samples per thread (kSamples = R * kThreads): the count at a threshold of rank q among the samples has a relative
// spread of about 1 / sqrt(q), so long rows need more samples for the same odds of a second gather pass (see
// select_row's choice of R).
template <int R>
__device__ __forceinline__ void sample_thresholds(const Row& row, int n, Shared& sh, uint32_t* bmin) {
  constexpr int kSamples = R * kThreads;
  const int tid = threadIdx.x;
  uint32_t o[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int l = static_cast<int>(static_cast<int64_t>(r * kThreads + tid) * row.nloc / kSamples);
    o[r] = row.ordered(__ldg(row.x + l), l);
  }
  // per lane l: the smallest / largest finite sample of the samples s = l (mod 32), which spread over the whole row
  // (0 / ~0u: none; neither is a finite score's ordered value). Scratch past bmin: buf holds no keys yet.
  uint32_t* lane_lo = bmin + kBins;
  uint32_t* lane_hi = lane_lo + 32;
  if (tid < 32) lane_lo[tid] = ~0u, lane_hi[tid] = 0u;
  for (int i = tid; i < kBins; i += kThreads) sh.hist[i] = 0, bmin[i] = ~0u;
  unsigned mn = ~0u, mx = 0u;
#pragma unroll
  for (int r = 0; r < R; ++r)
    if (o[r] > kOrderedNegInf && o[r] < kOrderedPosInf) mn = o[r] < mn ? o[r] : mn, mx = o[r] > mx ? o[r] : mx;
  __syncthreads();  // (lane_lo / lane_hi initialized)
  atomicMin(&lane_lo[tid & 31], mn);
  atomicMax(&lane_hi[tid & 31], mx);
  __syncthreads();
  // The buckets' range, robust to a few far outliers: 8 groups of 4 lanes, lo = the largest group minimum, hi = the
  // smallest group maximum (groups without a finite sample ignored). A far outlier (an attention sink, a large
  // finite mask value, a heavy tail's extreme) among the samples otherwise stretches the range so that the bulk
  // falls into a few buckets, the thresholds miss the gather's window and every miss is another pass over the row
  // (one sample of 1e3 amid normal scores: 128 rows of 128K 41.6 -> 246 us without it). It takes an outlier in
  // every group - 8 of them apart, or a run of ~29 consecutive samples - to stretch it. The samples outside it go to
  // the end buckets: about 20 at each end for normal scores (up to ~45), 28 for sorted ones (estimate_model.py's
  // robust_range). The walk's first threshold has rank q >= 2048 * kSamples / nloc - 1 (63 at 128K): inside the
  // range up to 128K local scores; beyond, it can fall among the samples above hi, which costs one more pass.
  const unsigned llo = lane_lo[tid & 31], lhi = lane_hi[tid & 31];
  unsigned glo = llo, ghi = lhi;
#pragma unroll
  for (int d = 1; d < 4; d <<= 1) {
    const unsigned a = __shfl_xor_sync(0xffffffffu, glo, d), b = __shfl_xor_sync(0xffffffffu, ghi, d);
    glo = a < glo ? a : glo, ghi = b > ghi ? b : ghi;
  }
  const unsigned all_lo = __reduce_min_sync(0xffffffffu, llo), all_hi = __reduce_max_sync(0xffffffffu, lhi);
  unsigned lo = __reduce_max_sync(0xffffffffu, glo == ~0u ? 0u : glo);
  unsigned hi = __reduce_min_sync(0xffffffffu, ghi == 0u ? ~0u : ghi);
  if (lo >= hi) lo = all_lo, hi = all_hi;  // (samples whose groups do not overlap, or one value: the whole range)
  // no finite sample: one range over every score part (the scores' range is then not finite: by the values)
  const bool finite = all_lo <= all_hi;
  const BucketMap<uint32_t, 0> bucket(finite ? lo : 0u, finite ? hi : ~0u);
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const int b = bucket(o[r]);
    atomicAdd(&sh.hist[b], 1);
    atomicMin(&bmin[b], o[r]);
  }
  __syncthreads();
  scan_bins(sh.hist, sh);  // the samples in the buckets before each (a rank)
  if (tid < kTries) {
    const int64_t want = n + static_cast<int64_t>(kBuf - n) * kFrac[tid] / 16;
    int q = static_cast<int>(want * kSamples / row.nloc) - 1;
    q = q < 0 ? 0 : (q > kSamples - 1 ? kSamples - 1 : q);
    int a = 0, z = kBins - 1;  // the last bucket starting at or before rank q: it holds rank q (never empty)
    while (a < z) {
      const int mid = (a + z + 1) >> 1;
      if (sh.hist[mid] <= q)
        a = mid;
      else
        z = mid - 1;
    }
    sh.tau[tid] = static_cast<int64_t>(bmin[a]) << 31;
  }
  __syncthreads();
}

namespace cg = cooperative_groups;

// One row's selection by C CTAs (one thread-block cluster; C = 1: one CTA, no cluster instruction runs). CTA c
// (its rank in the cluster) reads only its slice [row.beg, row.end) of the row; every decision (the estimate's
// thresholds from the same samples, the gathers' totals, the radix select's summed histograms) is the same in
// every CTA of the cluster, so all of them take the same path through the same cluster barriers.
template <bool VEC, bool CLUSTER, bool WIDE>
__device__ void select_row(const Row& row, int n, int64_t* out, Shared& sh, bool radix_only, int ctas, int c) {
  const int C = CLUSTER ? ctas : 1;  // a constant 1 compiles every cluster step out of the one-CTA kernel
  int64_t* buf = sh.buf;
  int* hist = sh.hist;
  const int tid = threadIdx.x, lane = tid & 31;
  const int nloc = row.nloc;
  cg::cluster_group cl = cg::this_cluster();
  int parity = 0;  // which sh.pub the next gather publishes

  // One level of a radix select, given the level's histogram of the keys with prefix P (bits >= shift): thread i
  // brings the counts h1, h0 of bins hi = kBins-1-2i and hi-1. The bin b of the need-th largest key among them
  // becomes P's next `width` bits (P <<= width, shift = lo), need drops by the keys in the bins above b. Returns
  // how many keys have a prefix >= the new P (the need-th largest included): the caller stops once they fit, or
  // at shift 0 (keys are unique).
  auto radix_level = [&](int h1, int h0, uint64_t& P, int& shift, int& need, int width, int lo) -> int {
    const int hi = kBins - 1 - 2 * tid;
    const int above = block_exclusive_sum(h1 + h0, sh.wsum);  // keys in the bins above hi (a descending scan)
    if (above < need && need <= above + h1) {
      sh.bin = hi, sh.above = above, sh.bin_count = h1;
    } else if (above + h1 < need && need <= above + h1 + h0) {
      sh.bin = hi - 1, sh.above = above + h1, sh.bin_count = h0;
    }
    __syncthreads();
    const int b = sh.bin;
    const int taken = n - need + sh.above;  // keys with a prefix above the new P
    need -= sh.above;
    P = (P << width) | static_cast<uint64_t>(b);
    shift = lo;
    const int fit = taken + sh.bin_count;
    __syncthreads();  // every thread read sh.bin / sh.bin_count before the next level rewrites them
    return shift == 0 ? 0 : fit;
  };

  // The level's histogram summed over the cluster (after this CTA's histogram of its slice is complete): the
  // counts of bins kBins-1-2*tid and the one below, from every CTA's shared memory.
  auto bin_counts = [&](int& h1, int& h0) {
    const int hi = kBins - 1 - 2 * tid;
    if (C == 1) {
      h1 = hist[hi], h0 = hist[hi - 1];
      return;
    }
    cl.sync();  // every CTA's histogram complete
    h1 = h0 = 0;
    for (int r = 0; r < C; ++r) {
      const int* h = cl.map_shared_rank(hist, r);
      h1 += h[hi], h0 += h[hi - 1];
    }
    cl.sync();  // every CTA read every histogram before any zeroes its own for the next level
  };

  // a lane's taken scores (bit e of `take` for its e-th score of the step at `base`) go to consecutive slots from
  // `slot`, one round per key (slots past kBuf dropped); key(s, l) makes the key of score s at local row l. The
  // score is picked from v by selects: an indexed v[e] would put the step's scores in local memory.
  auto store_taken = [&](unsigned take, int slot, const float (&v)[kPerStep], int base, auto key) {
    while (take != 0) {
      const int e = __ffs(static_cast<int>(take)) - 1;
      take &= take - 1;
      float s = v[0];
#pragma unroll
      for (int k = 1; k < kPerStep; ++k) s = e == k ? v[k] : s;
      if (slot < kBuf) buf[slot] = key(s, row_of<VEC>(base, e));
      ++slot;
    }
  };

  // gather every key >= lo into buf; returns how many there are (slots past kBuf dropped). A warp claims the slots
  // of a whole step with one shared atomic (one per element ballot made the single counter the bottleneck); key >= lo
  // is compared on the score part first, the id only on a tie.
  auto gather_from = [&](int64_t lo) -> int {
    if (tid == 0) sh.count = 0;
    __syncthreads();
    const uint32_t lo_o = static_cast<uint32_t>(lo >> 31);
    const int64_t lo_id = lo & 2147483647LL;
    // lo's score as a float: for a row without forced tokens, ordered(s) > lo_o <=> s > lo_f and ordered(s) ==
    // lo_o <=> s == lo_f (the order is the float order; -0 == +0 in both) when lo_f is a normal number or inf:
    // not for lo_o == 0 (NaN ranks lowest), and not for a zero or denormal lo_f, which the flush-to-zero of
    // --use_fast_math would merge with the denormal scores (a denormal s compared with a normal lo_f is on the
    // right side even when flushed)
    const uint32_t lo_bits = (lo_o & 0x80000000u) ? lo_o ^ 0x80000000u : lo_o ^ 0xffffffffu;
    const float lo_f = __uint_as_float(lo_bits);
    const bool fast = !row.forced && lo_o != 0 && (lo_bits & 0x7f800000u) != 0;
    const unsigned below = (1u << lane) - 1;
    for (int base = row.beg; base < row.end; base += kStep) {
      float v[kPerStep];
      load_step<VEC>(row, base, v);
      if (fast) {
        // few scores pass (~n / nloc), so the common work per score is two compares: bit e of `take` for the
        // thread's e-th score (the NaN padding past the slice never passes), the id only on a tie with lo_f; a
        // thread's taken keys go to consecutive slots from its warp's prefix sum of the counts
        unsigned take = 0;
        bool tie = false;
#pragma unroll
        for (int e = 0; e < kPerStep; ++e) {
          take |= static_cast<unsigned>(v[e] > lo_f) << e;
          tie |= v[e] == lo_f;
        }
        if (tie) {
#pragma unroll
          for (int e = 0; e < kPerStep; ++e)
            if (v[e] == lo_f && row.id_part(row_of<VEC>(base, e)) >= lo_id) take |= 1u << e;
        }
        const int cnt = __popc(take);
        int incl = cnt;  // the warp's inclusive prefix sum of the counts
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
          const int y = __shfl_up_sync(0xffffffffu, incl, o);
          if (lane >= o) incl += y;
        }
        const int total = __shfl_sync(0xffffffffu, incl, 31);
        if (total == 0) continue;  // (warp-uniform)
        int slot = 0;
        if (lane == 31) slot = atomicAdd(&sh.count, total);
        slot = __shfl_sync(0xffffffffu, slot, 31) + incl - cnt;
        // one round per taken score of the lane that took the most (usually one): a block per score position ran
        // each position's key code whenever any lane of the warp took that position - about half of all steps at
        // every position, ~45 % of the kernel's instructions at one row of 128K (ncu). The key is row.key's
        // without forced tokens (this path has none); the keys land in the same slots as a block per position's.
        store_taken(take, slot, v, base, [&](float s, int l) {
          return (static_cast<int64_t>(ordered_bits(__float_as_uint(s))) << 31) | row.id_part(l);
        });
        continue;
      }
      // whole keys (forced tokens, or a lo the float compare cannot stand for): few pass here too (~n / nloc of
      // the scores), so a lane stores its taken keys one round per key (store_taken), after every key of the lanes
      // below it (the ballots' counts; forced rows of >= 16K 2-19 % faster than a block per position).
      // The compares and slot claims stay a separate path from the fast one: one path for both cost unforced rows
      // 1-4 %.
      unsigned take = 0;
      int total = 0, slot = 0;
#pragma unroll
      for (int e = 0; e < kPerStep; ++e) {
        const int l = row_of<VEC>(base, e);
        const uint32_t o = row.ordered(v[e], l);
        const bool t = l < row.end && (o > lo_o || (o == lo_o && row.id_part(l) >= lo_id));
        take |= static_cast<unsigned>(t) << e;
        const unsigned m = __ballot_sync(0xffffffffu, t);
        total += __popc(m);
        slot += __popc(m & below);
      }
      if (total == 0) continue;  // (warp-uniform)
      int first = 0;
      if (lane == 0) first = atomicAdd(&sh.count, total);
      slot += __shfl_sync(0xffffffffu, first, 0);
      store_taken(take, slot, v, base, [&](float s, int l) { return row.key(s, l); });
    }
    __syncthreads();
    const int got = sh.count;
    __syncthreads();  // every thread read the count before a next gather resets it
    return got;
  };

  // every valid key of the slice (a row of <= kBuf scores): local row l's key goes to buf[l - beg], no compares,
  // no slot claims (the slot order never reaches the output: keys are unique, sorted later); returns how many there
  // are. Rows of 4K 12-18 % faster than gather_from(0)'s ballots and claims.
  auto gather_all = [&]() -> int {
    // Not unrolled over a step: this code runs once per row, so fetching its instructions (a cold instruction cache
    // in every SM) rather than executing them is its time - the step-unrolled form (~700 SASS instructions) stalled
    // on instruction fetch for 59 % of its samples (ncu); rolled, rows of 2K / 4K scores take 4 / 1-2.5 % less.
    // One 16-byte load (VEC) or four scalar ones per thread and pass, then one key at a
    // time.
#pragma unroll 1
    for (int l0 = row.beg + 4 * tid; l0 < row.end; l0 += 4 * kThreads) {
      float4 q;
      const float pad = __int_as_float(0x7fc00000);  // (never stored: l < end below)
      if (VEC && l0 + 4 <= row.end) {
        q = __ldg(reinterpret_cast<const float4*>(row.x + l0));
      } else {
        q.x = __ldg(row.x + l0);
        q.y = l0 + 1 < row.end ? __ldg(row.x + l0 + 1) : pad;
        q.z = l0 + 2 < row.end ? __ldg(row.x + l0 + 2) : pad;
        q.w = l0 + 3 < row.end ? __ldg(row.x + l0 + 3) : pad;
      }
#pragma unroll 1
      for (int j = 0; j < 4 && l0 + j < row.end; ++j) {
        const float s = j == 0 ? q.x : (j == 1 ? q.y : (j == 2 ? q.z : q.w));
        buf[l0 + j - row.beg] = row.key(s, l0 + j);
      }
    }
    __syncthreads();
    return row.end - row.beg;
  };

  // the total over the cluster of this CTA's gather count `got` (each CTA gathered its slice): sh.counts gets every
  // CTA's count. sh.pub alternates between two slots: a peer reads this gather's slot before it arrives at the next
  // gather's cluster barrier, which this CTA passes before it rewrites the slot (two gathers later).
  auto cluster_total = [&](int got) -> int {
    if (C == 1) return got;
    if (tid == 0) sh.pub[parity] = got;
    cl.sync();
    if (tid < C) sh.counts[tid] = *cl.map_shared_rank(&sh.pub[parity], tid);
    parity ^= 1;
    __syncthreads();
    int total = 0;
    for (int r = 0; r < C; ++r) total += sh.counts[r];
    return total;
  };
  auto gather_total = [&](int64_t lo) -> int { return cluster_total(gather_from(lo)); };

  int count;
  trace(0);
  if (nloc <= kBuf) {
    count = cluster_total(gather_all());
  } else {
    // ---- 1. estimate (it only decides the speed: a count outside [n, kBuf] falls back to the radix select)
    count = 0;
    if (!radix_only) {
      // thresholds for expected counts n + (kBuf - n) * f / 16, f = kFrac: the middle one first, then a higher
      // threshold after too many keys, a lower one after too few, each one more gather pass
      // One CTA per row, or a cluster of 2 (many rows, where the slowest row sets the kernel's time; WIDE): 4096
      // samples on rows of more than 64K. With 2048 a row of 128K normal scores missed the middle threshold's window
      // [n, kBuf] about 2 % of the time (numpy: a second pass over the row), so at 128 rows some row nearly
      // always did; with 4096, 0.15 %; 64K rows with 2048, 0.05 %. 2048 -> 4096: 128 rows of 128K, one CTA each,
      // 74.5 -> 51.2 us, 32 rows in clusters of 2 40.4 -> 30.8; 4096 samples on 64K rows cost more
      // than they saved (33.0 -> 35.1 us at 128 rows), 8192 on 128K rows spilled (59.6 us), and in clusters of 8 (8
      // rows, each CTA's second pass short) they cost 1.6 us. WIDE is a separate cluster instance: the wider
      // sampling compiled into the one cluster instance cost 0.2-0.3 us at one row of 16K-64K (code layout).
      uint32_t* scratch = reinterpret_cast<uint32_t*>(buf);
      if ((!CLUSTER || WIDE) && nloc > 65536)
        sample_thresholds<4>(row, n, sh, scratch);
      else
        sample_thresholds<2>(row, n, sh, scratch);
      trace(1);
      int t = kTries / 2, dir = 0;
      while (true) {
        count = gather_total(sh.tau[t]);
        trace_count(8);
        const int d = count > kBuf ? -1 : (count < n ? 1 : 0);  // -1: a higher threshold (smaller f)
        if (d == 0 || d == -dir || t + d < 0 || t + d >= kTries) break;
        dir = d, t += d;
      }
      trace(2);
    }
    if (count < n || count > kBuf) {
      // ---- 2. exact radix select: a histogram of the next kBits bits of every key matching the prefix P found
      // so far gives the bin holding the n-th largest key; P grows until the keys above P plus those equal to P
      // fit in buf. Heavy ties need up to six levels (the 31 id bits then decide).
      uint64_t P = 0;
      int shift = 63;  // keys are < 2^63: key >> 63 == 0 == P for every key
      int need = n;
      while (true) {
        const int width = shift < kBits ? shift : kBits, lo = shift - width;
        const uint64_t mask = (1ull << width) - 1;
        for (int i = tid; i < kBins; i += kThreads) hist[i] = 0;
        __syncthreads();
        for (int base = row.beg; base < row.end; base += kStep) {
          float v[kPerStep];
          load_step<VEC>(row, base, v);
#pragma unroll
          for (int e = 0; e < kPerStep; ++e) {
            const int l = row_of<VEC>(base, e);
            const bool in = l < row.end;
            const uint64_t u = in ? static_cast<uint64_t>(row.key(v[e], l)) : 0;
            const bool match = in && (u >> shift) == P;
            const unsigned act = __ballot_sync(0xffffffffu, match);
            if (match) {
              const int d = static_cast<int>((u >> lo) & mask);
              const unsigned peers = __match_any_sync(act, d);  // heavy ties: one shared atomic per bin per warp
              if (lane == __ffs(peers) - 1) atomicAdd(&hist[d], __popc(peers));
            }
          }
        }
        __syncthreads();
        int h1, h0;
        bin_counts(h1, h0);
        if (radix_level(h1, h0, P, shift, need, width, lo) <= kBuf) break;
      }
      // the keys with prefix >= P: the smallest such key is P << shift
      count = gather_total(static_cast<int64_t>(P << shift));
      trace(3);
    }
  }

  if (C > 1) {
    // ---- 3'. cluster: every CTA's gathered keys (sh.counts[c] <= count <= kBuf of them) go into CTA 0's buf side
    // by side (CTA c's after the counts of the CTAs before it; CTA 0's stay where they are), and CTA 0 selects and
    // sorts the count keys alone, as one CTA per row does (steps 3-4). (Each CTA sorting its own keys and placing
    // them by binary searches of every peer's sorted list took ~9 us at C = 8.)
    const int mine = sh.counts[c];
    if (c != 0) {
      int off = 0;
      for (int r = 0; r < c; ++r) off += sh.counts[r];
      int64_t* dst = cl.map_shared_rank(buf, 0) + off;
      for (int i = tid; i < mine; i += kThreads) dst[i] = buf[i];
    }
    cl.sync();  // every CTA's keys in CTA 0's buf (and visible to it); no CTA reads a peer's shared memory after it
    trace(7);
    if (c != 0) return;
  }

  // ---- 3. the n largest of the count <= kBuf gathered keys, sorted and stored, by buckets
  // (the second map only where the first overflowed, and only where it went by the scores; see bucket_top)
  const BucketResult br = bucket_top<false>(buf, count, n, out, sh);
  if (br == kBucketRetry) trace_count(9);
  if (br == kBucketDone || (br == kBucketRetry && bucket_top<true>(buf, count, n, out, sh) == kBucketDone)) {
    trace(4);
    trace(5);
    return;
  }

  // ---- 3b. (a bucket overflowed) trim: of more than 2 * kThreads gathered keys only the n <= 2 * kThreads largest
  // are needed, so an exact radix select over buf keeps the keys above the n-th largest key's prefix at the first
  // level where they fit in 2 * kThreads; the sort then holds 2 keys per thread instead of 4, about half its work
  // (the sort of 4096 keys was ~17 us of a one-SM select). The levels read buf afresh (keys held in
  // registers across them spilled at the 64 registers a 1024-thread CTA has).
  if (count > 2 * kThreads) {
    auto key_of = [&](int r) -> uint64_t {
      const int i = r * kThreads + tid;
      return i < count ? static_cast<uint64_t>(buf[i]) : 0;
    };
    uint64_t P = 0;
    int shift = 63, need = n;  // keys are >= 1 and < 2^63; the padding 0 never matches (u != 0)
    while (true) {
      const int width = shift < kBits ? shift : kBits, lo = shift - width;
      const uint64_t mask = (1ull << width) - 1;
      for (int i = tid; i < kBins; i += kThreads) hist[i] = 0;
      __syncthreads();
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const uint64_t u = key_of(r);
        const bool match = u != 0 && (u >> shift) == P;
        const unsigned act = __ballot_sync(0xffffffffu, match);
        if (match) {
          // a warp whose keys all fall in one bin (ties, the first levels) adds once; otherwise one atomic per
          // key (the gathered keys spread over the bins: fewer instructions than a match_any per key)
          const int d = static_cast<int>((u >> lo) & mask);
          const int lead = __ffs(act) - 1;
          if (__all_sync(act, d == __shfl_sync(act, d, lead))) {
            if (lane == lead) atomicAdd(&hist[d], __popc(act));
          } else {
            atomicAdd(&hist[d], 1);
          }
        }
      }
      __syncthreads();
      if (radix_level(hist[kBins - 1 - 2 * tid], hist[kBins - 2 - 2 * tid], P, shift, need, width, lo) <=
          2 * kThreads)
        break;
    }
    // keep the keys >= P << shift, compacted to the front of buf
    const uint64_t lo_key = P << shift;
    uint64_t v[4];
#pragma unroll
    for (int r = 0; r < 4; ++r) v[r] = key_of(r);
    if (tid == 0) sh.count = 0;
    __syncthreads();  // every key read (and the count reset) before buf is rewritten
    const unsigned below = (1u << lane) - 1;
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const bool keep = v[r] != 0 && v[r] >= lo_key;
      const unsigned m = __ballot_sync(0xffffffffu, keep);
      int slot = 0;
      if (lane == 0 && m) slot = atomicAdd(&sh.count, __popc(m));
      slot = __shfl_sync(0xffffffffu, slot, 0);
      if (keep) buf[slot + __popc(m & below)] = static_cast<int64_t>(v[r]);
    }
    __syncthreads();
    count = sh.count;
    __syncthreads();  // every thread read the count before anything resets it
    trace(6);
  }

  // ---- 4. sort the count <= 2 * kThreads (trimmed) keys into buf, descending, by the network
  sort_gathered<2>(buf, count);
  trace(4);
  const int valid = count < n ? count : n;
  for (int i = tid; i < n; i += kThreads) out[i] = i < valid ? buf[i] : -1;
  trace(5);
}

// Publishes row t's stored keys out[0, n) (see SelectParams::peers). Called by the CTA that stored them (CTA 0 of a
// cluster), every thread. The publish kernel of selector.py does this as a second launch after the selection
// (~4.5 us at one row on 2 x H200); here the peer stores start as soon as the row's keys are final.
// Out of line, so the publishing instances' selection code is allocated as in the others; the fields come by
// value (a reference to the kernel's parameters would copy them to the stack).
__device__ __noinline__ void publish_row(const int64_t* peers, int64_t* state, int64_t inbox, int K, int max_rows,
                                         int n, int W, int rank, int t, const int64_t* out) {
  const int tid = threadIdx.x;
  // this row's epoch; its only writers are this CTA and the publish kernel (merge() alone), in stream order
  const int64_t e = state[1 + t] + 1;
  // every thread's load of the epoch, and every thread's stores of the keys, before the epoch's store and the
  // keys' loads below (bar.sync orders the CTA's memory operations)
  __syncthreads();
  if (tid == 0) state[1 + t] = e;
  const int64_t slot = e & 1;
  for (int i = tid; i < K; i += kThreads) {
    const int64_t v = i < n ? out[i] : -1;
    for (int d = 0; d < W; ++d)
      if (d != rank)
        reinterpret_cast<int64_t*>(peers[d])[inbox + ((slot * W + rank) * max_rows + t) * K + i] = v;
  }
  __syncthreads();  // every thread's inbox stores before the flags' release (peer_memory.cuh: st_release_sys)
  if (tid < W && tid != rank)
    peerdcp::st_release_sys(reinterpret_cast<int64_t*>(peers[tid]) + (slot * W + rank) * max_rows + t, e);
}

// CLUSTER: launched with a.C > 1 CTAs per row in clusters of a.C (a separate instance: the cluster steps' registers
// stay out of the one-CTA kernel, which runs at the 64 registers a 1024-thread CTA allows). PUBLISH: a.peers is
// set (separate instances too: with the publish call in the one kernel, the selection alone ran up to 1 % slower -
// register allocation). WIDE (clusters only): the estimate's wider sampling of long rows,
// which one CTA per row always has (select_row).
template <bool CLUSTER, bool PUBLISH, bool WIDE>
__global__ void __launch_bounds__(kThreads) topk_select_kernel(const SelectParams a) {
  __shared__ Shared sh;
  // the merge kernel that follows TopK.select's publishing launch may start now (PDL): it waits for this grid's
  // completion before it reads anything, so its launch and start overlap the selection instead of following it
  if constexpr (PUBLISH) peerdcp::griddep_launch_dependents();
  // row t is cluster t (a 1-D grid of clusters of C consecutive CTAs; one CTA per row: CTA t), and this CTA is
  // its cluster's CTA c: both from special registers, not divisions. Five divisions at the start (t and c by the
  // runtime C, the local length's quotient and remainder in 64 bits - each behind the compiler's run-time check for
  // 32-bit operands - and the slice by C), ~20 instructions each, the first before the row length's load can issue,
  // cost rows of 2K / 4K scores (the shortest kernels) 0.4-0.5 us. The local length divides once, in 32 bits
  // (peerdcp::local_length, shared with the indexer scan).
  int t = blockIdx.x, c = 0;
  if constexpr (CLUSTER) {
    asm("mov.u32 %0, %%clusterid.x;" : "=r"(t));
    asm("mov.u32 %0, %%cluster_ctarank;" : "=r"(c));
  }
  const int64_t L = a.lens64 ? static_cast<const int64_t*>(a.seq_lens)[t] : static_cast<const int32_t*>(a.seq_lens)[t];
  // this rank's tokens among 0 .. L-1, at most the row's width
  const int64_t nl = peerdcp::local_length(L, a.rank, a.W, a.I);
  const int nloc = static_cast<int>(nl < a.Lmax ? nl : a.Lmax);
  // CTA c reads local rows [beg, end): C slices of a multiple of 4 rows (the 16-byte loads)
  const int per = CLUSTER ? ((nloc + a.C - 1) / a.C + 3) & ~3 : nloc;
  const int beg = c * per < nloc ? c * per : nloc, end = beg + per < nloc ? beg + per : nloc;
  const Row row{a.logits + static_cast<int64_t>(t) * a.logits_stride, L, a.force_first, a.force_last,
                a.rank, a.W, a.I, nloc, beg, end, a.force_first > 0 || a.force_last > 0};
  int64_t* out = a.out + static_cast<int64_t>(t) * a.n;
  if ((reinterpret_cast<uintptr_t>(a.logits) & 15) == 0 && (a.logits_stride & 3) == 0)
    select_row<true, CLUSTER, WIDE>(row, a.n, out, sh, a.radix_only != 0, a.C, c);
  else
    select_row<false, CLUSTER, WIDE>(row, a.n, out, sh, a.radix_only != 0, a.C, c);
  // (CTA 0 stored the row; the cluster's other CTAs returned from select_row after the funnel)
  if (PUBLISH && c == 0) publish_row(a.peers, a.state, a.inbox, a.K, a.max_rows, a.n, a.W, a.rank, t, out);
}

// A launch of `grid` CTAs of kThreads in clusters of `ctas` (attr: storage for the one attribute).
cudaLaunchConfig_t cluster_config(cudaLaunchAttribute* attr, int ctas, unsigned grid, cudaStream_t stream) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = dim3(grid);
  cfg.blockDim = dim3(kThreads);
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeClusterDimension;
  attr->val.clusterDim.x = ctas;
  attr->val.clusterDim.y = 1;
  attr->val.clusterDim.z = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  return cfg;
}

// The host's parameter block (peerdcp/topk/ops.py TopkSelectParams mirrors it: same order, same types), the one
// argument of peerdcp_topk_select; the entry point fills the kernel's SelectParams from it. Passed as void* with its
// size (see TopkMergeParams in merge.cu): a block of another size is refused with cudaErrorInvalidValue.
struct TopkSelectParams {
  int64_t* out;          // [T, n] int64 keys, descending, -1 tail
  const float* logits;   // row t at logits + t * logits_stride
  const void* seq_lens;  // [T] int32 or int64 (lens64) global lengths
  const int64_t* peers;  // publish: [W] every rank's buffer base address; nullptr: no publish
  int64_t* state;        // publish: [1 + max_rows] local: [aborted, epoch of row 0, ...]
  int64_t logits_stride, force_first, force_last;
  int64_t inbox;         // publish: word offset of the inbox [2, W, max_rows, K] in a buffer
  int32_t lens64, Lmax, n, T, rank, W, I, radix_only;
  int32_t ctas;          // CTAs per row (1 to kMaxCluster)
  int32_t K, max_rows;   // publish: the inbox's row length and rows
};

}  // namespace

extern "C" int peerdcp_topk_select_params_size() { return static_cast<int>(sizeof(TopkSelectParams)); }

// Local canonical candidates of T rows into out [T, n] (contiguous int64), n = min(topk, Lmax) in [1, kMaxN], by
// `ctas` (1 to kMaxCluster) CTAs per row (more than one: a thread-block cluster per row); with `peers` (not null)
// each row is then published to the direct Top-K's peers (SelectParams::peers; T <= max_rows, n <= K). Returns a
// CUDA error code (0 = launched).
extern "C" int peerdcp_topk_select(const void* params, int params_size, cudaStream_t stream) {
  if (params == nullptr || params_size != static_cast<int>(sizeof(TopkSelectParams)))
    return static_cast<int>(cudaErrorInvalidValue);
  const TopkSelectParams& p = *static_cast<const TopkSelectParams*>(params);
  const int n = p.n, Lmax = p.Lmax, T = p.T, W = p.W, I = p.I, rank = p.rank, ctas = p.ctas, K = p.K;
  const int max_rows = p.max_rows;
  const int64_t* peers = p.peers;
  if (n < 1 || n > kMaxN || Lmax < 1 || T < 0 || W < 1 || I < 1 || rank < 0 || rank >= W || ctas < 1 ||
      ctas > kMaxCluster)
    return static_cast<int>(cudaErrorInvalidValue);
  if (peers != nullptr &&
      (p.state == nullptr || K < n || T > max_rows || p.inbox < 2LL * W * max_rows || W > kThreads))
    return static_cast<int>(cudaErrorInvalidValue);
  if (T == 0) return 0;
  SelectParams a;
  a.out = p.out, a.logits = p.logits, a.logits_stride = p.logits_stride, a.seq_lens = p.seq_lens;
  a.lens64 = p.lens64;
  a.Lmax = Lmax, a.n = n, a.rank = rank, a.W = W, a.I = I, a.force_first = p.force_first;
  a.force_last = p.force_last;
  a.radix_only = p.radix_only;
  a.C = ctas;
  a.peers = peers, a.state = p.state, a.inbox = p.inbox, a.K = K, a.max_rows = max_rows;
  const bool pub = peers != nullptr;
  if (ctas == 1) {
    (pub ? topk_select_kernel<false, true, false> : topk_select_kernel<false, false, false>)<<<T, kThreads, 0, stream>>>(
        a);
    return static_cast<int>(cudaGetLastError());
  }
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, ctas, static_cast<unsigned>(T) * ctas, stream);
  // clusters of 2 (the most rows that still take clusters) over rows that may exceed 64K: the WIDE instances
  const bool wide = ctas <= 2 && Lmax > 65536;
  const auto kernel = pub ? (wide ? topk_select_kernel<true, true, true> : topk_select_kernel<true, true, false>)
                          : (wide ? topk_select_kernel<true, false, true> : topk_select_kernel<true, false, false>);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, a);
  return static_cast<int>(e != cudaSuccess ? e : cudaGetLastError());
}

// Most clusters of `ctas` CTAs of the selection kernel resident at once on the current device (clusters must fit
// in one GPC: fewer than SMs / ctas on H200), or -1 when the occupancy query fails.
extern "C" int peerdcp_topk_select_max_clusters(int ctas) {
  if (ctas < 2 || ctas > kMaxCluster) return -1;
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg = cluster_config(&attr, ctas, ctas, nullptr);
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, topk_select_kernel<true, false, false>, &cfg) != cudaSuccess) {
    cudaGetLastError();  // clear it: the caller falls back to one CTA per row
    return -1;
  }
  return n;
}

// Largest n the kernel selects (the host takes torch.topk above it).
extern "C" int peerdcp_topk_select_max_n() { return kMaxN; }

#ifdef PEERDCP_SELECT_TRACE
extern "C" int peerdcp_topk_select_trace(long long* host) {
  return static_cast<int>(cudaMemcpyFromSymbol(host, g_trace, sizeof(g_trace)));
}
#endif
