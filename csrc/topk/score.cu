// peerdcp Top-K: the lightning-indexer scan over SGLang's FP8 index-K pages in CUDA C++ for Hopper (sm_90a), the
// GPU path of `indexer_logits` (peerdcp/topk/cache.py) beside its Triton `_logits_kernel`; read that and
// `reference.indexer_logits_ref` first: same inputs, same output layout, the scores within fp32 rounding of them.
//
//   logits[t, l] = k_scale[l] * sum_h ReLU(q[t, h] . k[l]) * w[t, h]   for local rows l < nloc(t), -inf after
//
// A page is 64 tokens x 128 FP8 bytes, then 64 fp32 scales (8448 bytes). One CTA (one warpgroup, 128 threads)
// scores `npage` consecutive pages of one query row:
//   * the page table entries of its pages are read once, up front (one dependent load before the first page);
//   * the dot is one warpgroup MMA per 32 bytes of the head dim (wgmma m64nNk32, e4m3 x e4m3 -> fp32): the
//     page's 64 tokens are M (each warp holds 16 tokens' key bytes in registers, the "A from registers" form),
//     the heads are N (the query tile sits in shared memory for the whole CTA);
//   * each thread loads its own key bytes of a page from global memory into registers, one page ahead of the MMA
//     (keys never pass through shared memory). A ring of shared-memory page slots filled by bulk copies
//     (cp.async.bulk + mbarriers) measured no faster (the record in bench/RESULTS.md's History).
//
// The head dim is permuted the same way on both operands (a dot product does not care about the order of its
// terms): thread (g = lane / 4, c = lane % 4) of a warp needs, per k-step, 8 bytes of each of its two token rows,
// and with the permutation those are bytes [32c + 8s, 32c + 8s + 8) for step s, so each row's 32 bytes come in
// two 16-byte loads. The query tile is written once in the matching permuted, core-matrix layout.
//
// Every token's score goes through the same instructions whatever its page or row position (the MMA computes
// each output element alike; the head sum runs over the same heads in the same order in every quad), so an
// owner-sharded and a replicated scan give the same bits for a token, as the Triton kernel does.
#include <cuda_runtime.h>

#include <cstdint>

#include "peer_memory.cuh"

namespace {

constexpr int kPage = 64;                              // tokens per page
constexpr int kDim = 128;                              // FP8 bytes per key
constexpr int kPageBytes = kPage * kDim + kPage * 4;   // keys, then the fp32 scales
constexpr int kThreads = 128;                          // one warpgroup
constexpr int kMaxPages = 64;                          // most pages per CTA (table entries staged up front)

struct ScoreParams {
  const uint8_t* q;  // [T, H, 128] e4m3 bytes, row t at q + t * q_stride
  int64_t q_stride;
  const float* w;  // [T, H] fp32
  int64_t w_stride;
  const void* seq_lens;  // [T] int32 or int64 global lengths
  int lens64;
  const int32_t* table;  // [T, table_cols] local pages, or null (row t reads pages 0, 1, ...)
  int64_t table_stride;
  int64_t table_cols;
  const uint8_t* kv;  // num_pages x kPageBytes
  int64_t num_pages;
  float* out;  // [T, Lmax]
  int64_t out_stride;
  int64_t Lmax;
  int H, rank, W, I, sharded, npage;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Generic-proxy shared-memory accesses before this are ordered before later async-proxy ones (the MMA's reads of
// the query tile).
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }

// Shared-memory matrix descriptor of a K-major operand without swizzle: core matrices of 8 rows x 16 bytes,
// `lbo` bytes to the next core matrix along K, `sbo` bytes to the next 8 rows.
__device__ __forceinline__ uint64_t smem_desc(uint32_t addr, uint32_t lbo, uint32_t sbo) {
  return static_cast<uint64_t>((addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(lbo >> 4) << 16) |
         (static_cast<uint64_t>(sbo >> 4) << 32);
}

__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory"); }

template <int N>
struct Mma;

// D[64 x 32] (+)= A[64 x 32 bytes] (registers) x B[32 x 32] (shared, descriptor)
template <>
struct Mma<32> {
  template <int kAccumulate>
  __device__ __forceinline__ static void run(float (&d)[16], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(kAccumulate));
  }
};

// D[64 x 64] (+)= A[64 x 32 bytes] (registers) x B[32 x 64] (shared, descriptor)
template <>
struct Mma<64> {
  template <int kAccumulate>
  __device__ __forceinline__ static void run(float (&d)[32], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                             uint64_t desc) {
    asm volatile(
        "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, "
        "%12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, "
        "{%32, %33, %34, %35}, %36, p, 1, 1;\n}\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
          "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
          "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "l"(desc), "n"(kAccumulate));
  }
};

#ifdef PEERDCP_SCORE_TRACE
// Diagnosis build only (scripts/diag/scan_timeline.py sets PEERDCP_NVCC_EXTRA=-DPEERDCP_SCORE_TRACE): thread 0 of
// each of the first kTraceCtas CTAs stamps %globaltimer at its start, when its first page's key bytes are in
// registers and at its end; peerdcp_topk_score_trace copies the stamps out.
constexpr int kTraceCtas = 16384;
__device__ unsigned long long g_score_trace[kTraceCtas][3];
__device__ __forceinline__ void trace(int what) {
  const unsigned b = blockIdx.y * gridDim.x + blockIdx.x;
  if (threadIdx.x == 0 && b < kTraceCtas) {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    g_score_trace[b][what] = t;
  }
}
#define PEERDCP_SCORE_STAMP(what) trace(what)
#else
#define PEERDCP_SCORE_STAMP(what)
#endif

template <int N>
__host__ __device__ constexpr int q_tile_bytes() {
  return 4 * N * 32;  // 4 k-steps x N heads x 32 bytes
}

template <int N>
__host__ __device__ constexpr int smem_bytes() {
  return q_tile_bytes<N>() + kMaxPages * 8 + N * 4;
}

// One page's operands of a thread: 32 key bytes of rows r0 and r1 (lo: bytes 0-15 of the thread's 32, hi: 16-31)
// and the two rows' scales.
struct Frag {
  uint4 lo0, hi0, lo1, hi1;
  float sc0, sc1;
};

__device__ __forceinline__ Frag load_frag_global(const uint8_t* page, int r0, int r1, int c) {
  Frag f;
  const uint4* k0 = reinterpret_cast<const uint4*>(page + r0 * kDim + c * 32);
  const uint4* k1 = reinterpret_cast<const uint4*>(page + r1 * kDim + c * 32);
  f.lo0 = __ldg(k0), f.hi0 = __ldg(k0 + 1), f.lo1 = __ldg(k1), f.hi1 = __ldg(k1 + 1);
  const float* sc = reinterpret_cast<const float*>(page + kPage * kDim);
  f.sc0 = __ldg(sc + r0), f.sc1 = __ldg(sc + r1);
  return f;
}

// The page's MMA (4 k-steps against the query tile at `qbase`), the weighted ReLU head sum and the stores of the
// thread's rows into `orow` (page j of the output row): -inf at local rows >= nloc, nothing at columns >= Lmax.
template <int N>
__device__ __forceinline__ void score_page(const Frag& f, uint32_t qbase, const float* wsm, float* orow, int64_t j,
                                           int r0, int r1, int c, int64_t nloc, int64_t Lmax) {
  float d[N / 2];
  wgmma_fence();
  Mma<N>::template run<0>(d, f.lo0.x, f.lo1.x, f.lo0.y, f.lo1.y, smem_desc(qbase + 0 * N * 32, 128, 256));
  Mma<N>::template run<1>(d, f.lo0.z, f.lo1.z, f.lo0.w, f.lo1.w, smem_desc(qbase + 1 * N * 32, 128, 256));
  Mma<N>::template run<1>(d, f.hi0.x, f.hi1.x, f.hi0.y, f.hi1.y, smem_desc(qbase + 2 * N * 32, 128, 256));
  Mma<N>::template run<1>(d, f.hi0.z, f.hi1.z, f.hi0.w, f.hi1.w, smem_desc(qbase + 3 * N * 32, 128, 256));
  wgmma_commit();
  wgmma_wait_all();

  // d[4i + {0, 1}]: row r0, heads 8i + 2c + {0, 1}; d[4i + {2, 3}]: row r1, the same heads.
  float s0 = 0.f, s1 = 0.f;
#pragma unroll
  for (int k = 0; k < N / 8; ++k) {
    const float2 wk = *reinterpret_cast<const float2*>(wsm + 8 * k + 2 * c);
    s0 += fmaxf(d[4 * k], 0.f) * wk.x + fmaxf(d[4 * k + 1], 0.f) * wk.y;
    s1 += fmaxf(d[4 * k + 2], 0.f) * wk.x + fmaxf(d[4 * k + 3], 0.f) * wk.y;
  }
  // The quad's sum (the same bits in all four lanes: each step adds the same two values in either order).
  s0 += __shfl_xor_sync(0xffffffffu, s0, 1);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 1);
  s0 += __shfl_xor_sync(0xffffffffu, s0, 2);
  s1 += __shfl_xor_sync(0xffffffffu, s1, 2);
  if (c < 2) {
    const int r = c == 0 ? r0 : r1;
    const int64_t l = j * kPage + r;
    if (l < Lmax) orow[r] = l < nloc ? (c == 0 ? s0 * f.sc0 : s1 * f.sc1) : -__int_as_float(0x7f800000);
  }
}

// Grid (T, ceil(pages / npage)); shared memory: query tile | page numbers | head weights.
template <int N, int kMinCtas>
__global__ void __launch_bounds__(kThreads, kMinCtas) score_kernel(const ScoreParams p) {
  extern __shared__ __align__(128) uint8_t smem[];
  uint8_t* qtile = smem;
  int64_t* pages = reinterpret_cast<int64_t*>(qtile + q_tile_bytes<N>());
  float* wsm = reinterpret_cast<float*>(pages + kMaxPages);

  PEERDCP_SCORE_STAMP(0);
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
  const int64_t t = blockIdx.x;
  const int64_t j0 = static_cast<int64_t>(blockIdx.y) * p.npage;
  const int64_t npages_all = (p.Lmax + kPage - 1) / kPage;
  const int n_here = static_cast<int>(min(static_cast<int64_t>(p.npage), npages_all - j0));

  // Every global load of the start is issued before any of them is used: the sequence length, this CTA's page
  // table entries (masked by the table's width, not by the row's length, so they do not wait for it), the query
  // words and the head weights. Then one dependent step - a page's liveness needs the length - before the first
  // page's load; the query tile's shared-memory writes overlap that load. (Loading the first page's keys before the
  // length arrives, and a 32-bit local_length, measured no faster.)
  const int64_t L = p.lens64 ? static_cast<const int64_t*>(p.seq_lens)[t] : static_cast<const int32_t*>(p.seq_lens)[t];
  int64_t entry = -1;
  if (tid < n_here) {
    const int64_t j = j0 + tid;
    if (p.table == nullptr) {
      entry = j;
    } else if (j < p.table_cols) {
      entry = static_cast<int64_t>(p.table[t * p.table_stride + j]);
    }
  }
  constexpr int kVecs = N * kDim / 16 / kThreads;  // 16-byte query pieces per thread
  uint4 qv[kVecs];
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int idx = tid + k * kThreads, n = idx >> 3, d = (idx & 7) << 4;
    qv[k] = n < p.H ? *reinterpret_cast<const uint4*>(p.q + t * p.q_stride + n * kDim + d) : make_uint4(0, 0, 0, 0);
  }
  float wt = 0.f;
  if (tid < N && tid < p.H) wt = p.w[t * p.w_stride + tid];

  // The first page's table entry, in every thread (one broadcast load per warp): its key loads need not wait for
  // the barrier that publishes the CTA's page numbers.
  const int64_t entry0 = p.table == nullptr ? j0 : (j0 < p.table_cols ? p.table[t * p.table_stride + j0] : -1);

  const int64_t nloc = p.sharded ? peerdcp::local_length(L, p.rank, p.W, p.I) : L;
  const int64_t npg_row = (nloc + kPage - 1) / kPage;
  // Page number of local page j with table entry e: -1 past the row's end or its table (no load: -inf scores;
  // liveness is j < min(npg_row, table_cols), so once a page is dead every later page is); a bad table entry reads
  // a wrong page, never out of bounds.
  auto page_of = [&](int64_t j, int64_t e) -> int64_t {
    const bool live = (p.table == nullptr || j < p.table_cols) && j < npg_row;
    return live ? (e < 0 ? 0 : (e >= p.num_pages ? p.num_pages - 1 : e)) : -1;
  };
  const int64_t page0 = n_here > 0 ? page_of(j0, entry0) : -1;
  const int r0 = warp * 16 + g, r1 = r0 + 8;  // the rows this thread holds: A fragment rows g, g + 8 of its warp's 16
  Frag next{};                                 // the next page's operands, one page ahead
  if (page0 >= 0) next = load_frag_global(p.kv + page0 * kPageBytes, r0, r1, c);
  if (tid < n_here) pages[tid] = page_of(j0 + tid, entry);  // (read after the barrier below)
  // The query tile, B of the MMA: k-step s holds N heads x 32 permuted bytes in core matrices (8 heads x 16
  // bytes, 128 B each; +128 B to the next 16 bytes of K, +256 B to the next 8 heads). Physical byte d of a head
  // is logical byte 16 * ((d >> 2) & 1) + 4 * (d >> 5) + (d & 3) of step (d >> 3) & 3 (see the top comment).
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int idx = tid + k * kThreads, n = idx >> 3;
    const uint32_t words[4] = {qv[k].x, qv[k].y, qv[k].z, qv[k].w};
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = ((idx & 7) << 4) + 4 * e;
      const int s = (d >> 3) & 3, hi = (d >> 2) & 1, cq = d >> 5;
      *reinterpret_cast<uint32_t*>(qtile + s * (N * 32) + (n >> 3) * 256 + hi * 128 + (n & 7) * 16 + cq * 4) =
          words[e];
    }
  }
  if (tid < N) wsm[tid] = wt;  // head weights (zero past H: no term)
  fence_proxy_async();  // the query tile (generic stores) before the MMA reads it
  __syncthreads();

  const uint32_t qbase = smem_addr(qtile);
  for (int i = 0; i < n_here; ++i) {
    const int64_t j = j0 + i;
    float* orow = p.out + t * p.out_stride + j * kPage;
    if (pages[i] < 0) {  // past the row's end or its table (every later page too): -inf where there are columns
      if (tid < kPage && j * kPage + tid < p.Lmax) orow[tid] = -__int_as_float(0x7f800000);
      continue;
    }
    // Each thread's 2 x 32 key bytes and 2 scales of the next page go straight from global memory into registers
    // (the A operand needs nothing else), one page ahead of the MMA; no shared memory for keys, no barrier per page.
    const Frag cur = next;
    if (i + 1 < n_here && pages[i + 1] >= 0) next = load_frag_global(p.kv + pages[i + 1] * kPageBytes, r0, r1, c);
#ifdef PEERDCP_SCORE_TRACE
    if (i == 0) {  // the stamp waits for the first page's key bytes (the asm reads them)
      asm volatile("" ::"r"(cur.lo0.x), "r"(cur.hi1.w));
      PEERDCP_SCORE_STAMP(1);
    }
#endif
    score_page<N>(cur, qbase, wsm, orow, j, r0, r1, c, nloc, p.Lmax);
  }
  PEERDCP_SCORE_STAMP(2);
}

using Kernel = void (*)(const ScoreParams);

// The compiled instances: a register budget (CTAs per SM the compiler must allow; 1 = none) x head tile (32 or 64).
struct Instance {
  int min_ctas;
  Kernel narrow, wide;
};

const Instance kInstances[] = {{1, score_kernel<32, 1>, score_kernel<64, 1>},
                               {6, score_kernel<32, 6>, score_kernel<64, 6>}};

const Instance* find(int min_ctas) {
  for (const Instance& in : kInstances)
    if (in.min_ctas == min_ctas) return &in;
  return nullptr;
}

// The host's parameter block (peerdcp/topk/ops.py TopkScoreParams mirrors it: same order, same types), the one
// argument of peerdcp_topk_score; the entry point fills the kernel's ScoreParams from it. Passed as void* with its
// size (see TopkMergeParams in merge.cu): a block of another size is refused with cudaErrorInvalidValue.
struct TopkScoreParams {
  const void* q;          // [T, H, 128] e4m3 bytes, row t at q + t * q_stride
  const float* w;         // [T, H] fp32
  const void* seq_lens;   // [T] int32 or int64 (lens64) global lengths
  const int32_t* table;   // [T, table_cols] local pages, or null
  const void* kv;         // num_pages x kPageBytes
  float* out;             // [T, Lmax]
  int64_t q_stride, w_stride, table_stride, table_cols, num_pages, out_stride, Lmax;
  int32_t lens64, T, H, rank, W, I, sharded, npage;
  int32_t min_ctas;       // the instance: its register budget as CTAs per SM
};

}  // namespace

// Resident CTAs per SM of the instance `min_ctas` for `narrow` (H <= 32) or wide heads on the current device; -1
// when the instance does not exist or the query fails.
extern "C" int peerdcp_topk_score_occupancy(int min_ctas, int narrow) {
  const Instance* in = find(min_ctas);
  if (in == nullptr) return -1;
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, narrow ? in->narrow : in->wide, kThreads,
                                                    narrow ? smem_bytes<32>() : smem_bytes<64>()) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  return n;
}

extern "C" int peerdcp_topk_score_params_size() { return static_cast<int>(sizeof(TopkScoreParams)); }

// The scan of T rows on `stream` with the instance `min_ctas`: heads 1..64 (a 32-head tile up to 32 heads), 1 to
// kMaxPages pages per CTA. q, the pages and the query rows must be 16-byte aligned (the host checks).
extern "C" int peerdcp_topk_score(const void* params, int params_size, cudaStream_t stream) {
  if (params == nullptr || params_size != static_cast<int>(sizeof(TopkScoreParams)))
    return static_cast<int>(cudaErrorInvalidValue);
  const TopkScoreParams& p = *static_cast<const TopkScoreParams*>(params);
  const int T = p.T, H = p.H, W = p.W, I = p.I, rank = p.rank, npage = p.npage;
  const int64_t Lmax = p.Lmax;
  const Instance* in = find(p.min_ctas);
  if (in == nullptr || T < 0 || H < 1 || H > 64 || Lmax < 0 || npage < 1 || npage > kMaxPages || W < 1 || I < 1 ||
      rank < 0 || rank >= W || p.num_pages < 1)
    return static_cast<int>(cudaErrorInvalidValue);
  if (T == 0 || Lmax == 0) return 0;
  ScoreParams a;
  a.q = static_cast<const uint8_t*>(p.q), a.q_stride = p.q_stride, a.w = p.w, a.w_stride = p.w_stride;
  a.seq_lens = p.seq_lens, a.lens64 = p.lens64, a.table = p.table, a.table_stride = p.table_stride;
  a.table_cols = p.table_cols, a.kv = static_cast<const uint8_t*>(p.kv), a.num_pages = p.num_pages, a.out = p.out;
  a.out_stride = p.out_stride, a.Lmax = Lmax, a.H = H, a.rank = rank, a.W = W, a.I = I, a.sharded = p.sharded;
  a.npage = npage;
  const int64_t chunks = ((Lmax + kPage - 1) / kPage + npage - 1) / npage;
  if (chunks > 65535) return static_cast<int>(cudaErrorInvalidValue);
  const dim3 grid(static_cast<unsigned>(T), static_cast<unsigned>(chunks));
  const bool narrow = H <= 32;
  (narrow ? in->narrow : in->wide)<<<grid, kThreads, narrow ? smem_bytes<32>() : smem_bytes<64>(), stream>>>(a);
  return static_cast<int>(cudaGetLastError());
}

#ifdef PEERDCP_SCORE_TRACE
// Copies the stamps of the first `ctas` CTAs of the last launch ([ctas][3] nanoseconds) to `host`.
extern "C" int peerdcp_topk_score_trace(unsigned long long* host, int ctas) {
  if (ctas < 0 || ctas > kTraceCtas) return static_cast<int>(cudaErrorInvalidValue);
  return static_cast<int>(cudaMemcpyFromSymbol(host, g_score_trace, sizeof(unsigned long long) * 3 * ctas));
}
#endif
