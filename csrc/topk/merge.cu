// peerdcp Top-K: the merge of W sorted candidate lists into the exact global top-k, in CUDA C++ (the
// twin of `_merge_kernel` in peerdcp/topk/kernels.py; read that docstring first: same inputs, same output).
//
// Grid (T, S): S CTAs per row t (S = 1 when there are enough rows to fill the GPU). Every CTA of the row
// stages the row's W lists in shared memory (W x K int64 keys, -1 past its valid length); the output
// position of key x = list_a[j] is j + sum_{b != a} #{y in list_b : y > x} (keys are unique over all lists,
// every list is sorted descending with a -1 tail), found by binary searches in shared memory.
//
// Place-all mode (`place_all`, few rows: the host's `policy.grid` gives it when the CTAs that fit at once leave every
// thread at most two of the row's W x K keys): CTA s places keys s*kThreads + tid, s*kThreads + tid + S*kThreads, ... of
// the W x K slots, each key's searches stopping once its rank reaches K; no cut-off search. One row on one H200:
// 7.1 -> 4.0 us at W = 2, 22.3 -> 10.8 us at W = 8 against cut-off mode, where the cut-off search below, repeated by
// every CTA of the row, costs most of the time.
//
// Cut-off mode: only the K keys that reach the output are placed. The rank of list_a[j] grows with j, so list a
// contributes its first c_a keys, c_a = #{j : rank(list_a[j]) < K}; every CTA finds the W cut-offs by a
// parallel (kThreads / W)-ary search (two or three rounds), then its CTAs split the M = sum_a c_a = min(N, K)
// surviving keys between them. A surviving key's searches stop at c_b (a key above it in list b also
// survives). This is W times less search work than placing all W x K keys with one CTA per row (36.7 us for
// one row at W = 4). Positions 0..M-1 are each written once, [M, K) get -1
// from the kernel itself: no pre-fill, no sort, no atomics on the output. The Triton kernel searches L2 (it
// cannot index shared memory), 8 bytes per 32-byte sector; it is the CPU-interpreter path and the twin.
//
// Direct mode: the own list is read from `own` (this rank's candidates), the peers' from this rank's
// inbox after a bounded acquire wait for each peer's flag of row t (value = the row's epoch, which the
// publish kernel advanced earlier on the stream). A timed-out wait records the error word, sets the
// object's `aborted` word, and the row is written as all -1 (the host raises PeerTimeoutError at the
// next call); once aborted no later call waits again.
#include <cuda_runtime.h>

#include <cstdint>

#include "peer_memory.cuh"

namespace {

constexpr int kMaxW = 8;
constexpr int kThreads = 512;

struct MergeParams {
  int32_t* out;            // [T, K] int32 global ids (-1 where no candidate reaches)
  const int64_t* own;      // direct: own candidate keys, row t at own + t * own_stride
  int64_t own_stride;      // elements
  int own_len;             // valid entries of an own row (the rest reads as -1)
  const int64_t* lists;    // list b of row t at lists + slot*slot_stride + b*list_stride + t*row_stride
  int64_t slot_stride, list_stride, row_stride;
  int list_len;            // valid entries of a list row
  const int64_t* flags;    // direct: this rank's flags [2, W, max_rows]
  int64_t* state;          // direct: [aborted, epoch of row 0, ...]
  int64_t* err;            // int64[8] error word (pinned host memory)
  int64_t timeout_ns;
  int rank, W, K, max_rows, mech, direct;
  int place_all;           // 1: no cut-off search; the row's CTAs place every valid key whose rank is < K
};

// Rank of key x = sh[a][j] among all W lists (lists b searched over their first n[b] keys), or >= K.
__device__ __forceinline__ int rank_of(const int64_t* sh, const int* n, int W, int K, int a, int j, int64_t x) {
  int r = j;
  for (int b = 0; b < W && r < K; ++b)
    if (b != a) r += peerdcp::count_greater(sh + b * K, n[b], x);
  return r;
}

__global__ void __launch_bounds__(kThreads) topk_merge_kernel(const MergeParams a) {
  extern __shared__ int64_t sh[];  // [W][K]
  __shared__ int ok_sh;
  __shared__ int nvalid_sh[kMaxW];  // valid keys of list b
  __shared__ int lo_sh[kMaxW], hi_sh[kMaxW], hits_sh[kMaxW];  // the cut-off search; after it lo_sh[b] = c_b
  const int t = blockIdx.x, s = blockIdx.y, S = gridDim.y, tid = threadIdx.x, W = a.W, K = a.K;
  int32_t* out = a.out + static_cast<int64_t>(t) * K;
  // launched with PDL (TopK.select after the selection kernel published the rows): nothing of the selection's -
  // the epochs, the own keys - is read before it completed; without PDL this returns at once
  peerdcp::griddep_wait();
  int slot = 0;
  if (tid == 0) ok_sh = 1;
  __syncthreads();
  if (a.direct) {
    // every CTA of the row waits for itself: the peers' lists must be visible to its own loads
    const int64_t epoch = a.state[1 + t];  // written by the publish kernel, earlier on the stream
    slot = static_cast<int>(epoch & 1);
    if (tid < W && tid != a.rank) {
      const volatile int64_t* aborted = a.state;
      bool ok = *aborted == 0;
      if (ok) {
        const int64_t* flag = a.flags + (static_cast<int64_t>(slot) * W + tid) * a.max_rows + t;
        ok = peerdcp::wait_equal_sys(flag, epoch, a.timeout_ns, a.err, a.rank, tid, a.mech);
        if (!ok) a.state[0] = 1;  // later calls skip their waits (the host refuses them anyway)
      }
      if (!ok) atomicAnd(&ok_sh, 0);
    }
    __syncthreads();
  }
  if (ok_sh == 0) {
    for (int i = s * kThreads + tid; i < K; i += S * kThreads) out[i] = -1;
    return;
  }
  // ---- stage every list of row t (inbox reads after the acquire: __ldcg, L2 only, never a stale L1 line)
  for (int b = 0; b < W; ++b) {
    const int64_t* src;
    int len;
    if (a.direct && b == a.rank) {
      src = a.own + static_cast<int64_t>(t) * a.own_stride;
      len = a.own_len;
    } else {
      src = a.lists + slot * a.slot_stride + b * a.list_stride + t * a.row_stride;
      len = a.list_len;
    }
    len = len < K ? len : K;
    for (int i = tid; i < K; i += kThreads) sh[b * K + i] = i < len ? __ldcg(src + i) : -1;
  }
  __syncthreads();
  if (tid < W) {
    const int n = peerdcp::count_greater(sh + tid * K, K, -1);  // keys are >= 1, the tail -1
    nvalid_sh[tid] = n;
    lo_sh[tid] = 0;
    hi_sh[tid] = n;
    hits_sh[tid] = 0;
  }
  __syncthreads();
  if (a.place_all) {
    // ---- many CTAs per row (few rows): each places its share of all W x K slots' valid keys, the searches
    // stopping once a rank reaches K, instead of every CTA repeating the cut-off search
    int N = 0;
    for (int b = 0; b < W; ++b) N += nvalid_sh[b];
    for (int f = s * kThreads + tid; f < W * K; f += S * kThreads) {
      const int list = f / K, j = f - list * K;
      if (j >= nvalid_sh[list]) continue;
      const int64_t x = sh[f];
      const int pos = rank_of(sh, nvalid_sh, W, K, list, j, x);
      if (pos < K) out[pos] = static_cast<int32_t>(2147483647 - (x & 2147483647));
    }
    for (int i = (N < K ? N : K) + s * kThreads + tid; i < K; i += S * kThreads) out[i] = -1;
    return;
  }
  // ---- cut-offs: c_a in [lo_a, hi_a]; each round the L lanes of list a test L evenly spaced j
  // (pred(j) = rank(list_a[j]) < K is true then false), hits = how many were true
  const int L = kThreads / W, my = tid / L, lane = tid - my * L;
  bool more = true;
  while (__syncthreads_or(more)) {
    int lo = 0, hi = 0, step = 1;
    if (my < W) {
      lo = lo_sh[my], hi = hi_sh[my];
      step = (hi - lo + L - 1) / L;
      const int j = lo + lane * step;
      if (hi > lo && j < hi && rank_of(sh, nvalid_sh, W, K, my, j, sh[my * K + j]) < K) atomicAdd(&hits_sh[my], 1);
    }
    __syncthreads();
    if (my < W && lane == 0 && hi > lo) {
      const int h = hits_sh[my];
      lo_sh[my] = h == 0 ? lo : lo + (h - 1) * step + 1;
      hi_sh[my] = h == 0 ? lo : min(hi, lo + h * step);
      hits_sh[my] = 0;
    }
    __syncthreads();
    more = my < W && lo_sh[my] < hi_sh[my];
  }
  // ---- place the M surviving keys (positions 0..M-1), CTA s taking every S-th group of kThreads
  int M = 0;
  for (int b = 0; b < W; ++b) M += lo_sh[b];
  for (int f = s * kThreads + tid; f < M; f += S * kThreads) {
    int list = 0, j = f;
    while (j >= lo_sh[list]) j -= lo_sh[list++];
    const int64_t x = sh[list * K + j];
    const int pos = rank_of(sh, lo_sh, W, K, list, j, x);
    out[pos] = static_cast<int32_t>(2147483647 - (x & 2147483647));
  }
  // ---- positions no valid key reaches
  for (int i = M + s * kThreads + tid; i < K; i += S * kThreads) out[i] = -1;
}

// The host's parameter block (peerdcp/topk/ops.py TopkMergeParams mirrors it: same order, same types), the one
// argument of peerdcp_topk_merge; the entry point fills the kernel's MergeParams from it. Passed as void* with its
// size: it lives in an unnamed namespace (a signature naming it would get internal linkage even declared extern "C"),
// and a block of another size (a stale mirror) is refused with cudaErrorInvalidValue.
struct TopkMergeParams {
  int32_t* out;
  const int64_t* own;
  const int64_t* lists;
  const int64_t* flags;
  int64_t* state;
  void* err;
  int64_t own_stride, slot_stride, list_stride, row_stride, timeout_ns;
  int32_t own_len, list_len, rank, W, K, T, max_rows, mech, direct;
  int32_t ctas_per_row;  // the grid's y: CTAs per row
  int32_t place_all;
  int32_t pdl;           // launch with programmatic dependent launch
};

}  // namespace

extern "C" int peerdcp_topk_merge_params_size() { return static_cast<int>(sizeof(TopkMergeParams)); }

extern "C" int peerdcp_topk_merge(const void* params, int params_size, cudaStream_t stream) {
  if (params == nullptr || params_size != static_cast<int>(sizeof(TopkMergeParams)))
    return static_cast<int>(cudaErrorInvalidValue);
  const TopkMergeParams& p = *static_cast<const TopkMergeParams*>(params);
  const int W = p.W, K = p.K, T = p.T, ctas_per_row = p.ctas_per_row;
  if (W < 1 || W > kMaxW || K < 1 || T < 0 || ctas_per_row < 1 || ctas_per_row > 65535)
    return static_cast<int>(cudaErrorInvalidValue);
  if (T == 0) return 0;
  MergeParams a;
  a.out = p.out, a.own = p.own, a.own_stride = p.own_stride, a.own_len = p.own_len;
  a.lists = p.lists, a.slot_stride = p.slot_stride, a.list_stride = p.list_stride, a.row_stride = p.row_stride;
  a.list_len = p.list_len, a.flags = p.flags, a.state = p.state, a.err = static_cast<int64_t*>(p.err);
  a.timeout_ns = p.timeout_ns, a.rank = p.rank, a.W = W, a.K = K, a.max_rows = p.max_rows, a.mech = p.mech;
  a.direct = p.direct, a.place_all = p.place_all;
  // More than 48 KiB of dynamic shared memory needs the opt-in that peerdcp_topk_merge_max_keys made for
  // this device (it is not done here: a CUDA graph may be capturing this launch).
  const size_t smem = static_cast<size_t>(W) * K * sizeof(int64_t);
  // pdl: programmatic dependent launch - the CTAs may start while the previous kernel on the stream (the selection
  // kernel, which lets them launch as its CTAs start) still runs, and wait for it in griddep_wait
  cudaLaunchAttribute attr;
  const cudaLaunchConfig_t cfg =
      peerdcp::launch_config(&attr, dim3(T, ctas_per_row), dim3(kThreads), smem, stream, p.pdl);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, topk_merge_kernel, a);
  return static_cast<int>(e != cudaSuccess ? e : cudaGetLastError());
}

// Largest W * K (int64 keys) one CTA can stage on `device` (the host falls back to Triton above it), after
// opting the kernel in to that much dynamic shared memory on `device` (once per device, before any launch;
// TopK's constructor calls it). 0 on error.
extern "C" int64_t peerdcp_topk_merge_max_keys(int device) {
  int v = 0, prev = 0;
  cudaFuncAttributes fa;
  if (cudaDeviceGetAttribute(&v, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess) return 0;
  if (cudaFuncGetAttributes(&fa, topk_merge_kernel) != cudaSuccess) return 0;
  const int dyn = v - static_cast<int>(fa.sharedSizeBytes);  // less the kernel's static shared memory
  if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(device) != cudaSuccess) return 0;
  const cudaError_t e = cudaFuncSetAttribute(topk_merge_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, dyn);
  cudaSetDevice(prev);
  if (e != cudaSuccess) return 0;
  return static_cast<int64_t>(dyn) / static_cast<int64_t>(sizeof(int64_t));
}
