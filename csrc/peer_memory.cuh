// Device helpers shared by peerdcp's CUDA kernels (generic: no mechanism-specific layout here).
//
// Memory-ordering vocabulary (PTX memory model):
//   * st_release_sys: a system-scope release store. Issued by one thread right after __syncthreads(), it
//     orders every store the CTA made before the barrier (bar.sync is CTA-scope synchronization, and
//     causality order is transitive) before the flag, for any observer that acquires the flag.
//   * ld_acquire_sys: the matching acquire load; later loads (of this thread, and of the CTA after a
//     __syncthreads()) observe everything the releasing CTA stored before its release.
//   * Inbox payload is read with __ldcg (L2, never L1), so no line cached from an earlier use of the
//     same slot can be returned.
//   * Errors go to an int64[8] word in pinned, device-mapped host memory:
//       [0] set, [1] waiting rank, [2] missing peer, [3] mechanism code, [4] awaited value, [7] claim.
//     The host reads it without synchronizing the stream; nothing here ever traps.
#pragma once

#include <cstdint>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

namespace peerdcp {

// Division by a divisor fixed for the call (heads, items per row, ...), for dividends in [0, 2^31): the
// round-up reciprocal method (Granlund & Montgomery; Hacker's Delight 10-9), q = (umulhi(x, m) + x) >> s with
// s = ceil(log2 d), m = floor(2^32 (2^s - d) / d) + 1, exact for every such x. The host computes (m, s) once
// per launch; a division by a runtime int is ~20 dependent instructions (I2F, MUFU.RCP, F2I, IMAD.HI, fix-ups)
// on the kernels' address paths, this is two. tests/test_fastdiv.py checks the formula; the GPU
// byte-identity tests of the Query and Output kernels run it.
struct FastDiv {
  uint32_t m, s;
  int d;
  __host__ static FastDiv make(int d) {  // d < 1: a divisor the call never divides by (no items); the identity
    if (d < 1) d = 1;
    uint32_t s = 0;
    while ((1ull << s) < (uint64_t)d) ++s;
    return {(uint32_t)((((uint64_t)1 << 32) * (((uint64_t)1 << s) - (uint64_t)d)) / (uint64_t)d + 1), s, d};
  }
  __device__ __forceinline__ int div(int x) const { return (int)((__umulhi((uint32_t)x, m) + (uint32_t)x) >> s); }
};

__device__ __forceinline__ void st_release_sys(int64_t* p, int64_t v) {
  asm volatile("st.release.sys.global.b64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ int64_t ld_acquire_sys(const int64_t* p) {
  int64_t v;
  asm volatile("ld.acquire.sys.global.b64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Programmatic dependent launch (PTX ISA 7.8, sm_90). griddep_wait returns once the grid before this one on the
// stream has completed and its memory is visible (at once when this grid was not launched with
// cudaLaunchAttributeProgrammaticStreamSerialization); griddep_launch_dependents lets the next such grid launch
// (it launches once every CTA of this grid did so or exited).
__device__ __forceinline__ void griddep_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void griddep_launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// The configuration of a launch of `grid` x `block` threads with `smem` bytes of dynamic shared memory on `stream`,
// with programmatic dependent launch when `pdl` (cudaLaunchAttributeProgrammaticStreamSerialization: the grid may
// start while the previous kernel on the stream still runs, so it must griddep_wait before it reads anything that
// kernel wrote; captured into a CUDA graph it becomes a programmatic edge). `attr` holds the attribute and must
// outlive the cudaLaunchKernelEx call.
inline cudaLaunchConfig_t launch_config(cudaLaunchAttribute* attr, dim3 grid, dim3 block, size_t smem,
                                        cudaStream_t stream, bool pdl) {
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  attr->id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr->val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  return cfg;
}

__device__ __forceinline__ uint64_t global_timer_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// LL (NCCL's low-latency protocol): 8-byte words {4 data bytes, 4 flag bytes}, two per 16-byte store.
// An aligned 8-byte store is seen whole, so a reader that sees the flag of a word sees its data: no
// fence and no separate flag. Volatile accesses go to L2 (never L1).
__device__ __forceinline__ void st_volatile_v4(uint4* p, uint32_t a, uint32_t b, uint32_t c, uint32_t d) {
  asm volatile("st.volatile.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(p), "r"(a), "r"(b), "r"(c), "r"(d)
               : "memory");
}

__device__ __forceinline__ void st_volatile_v2(uint2* p, uint32_t a, uint32_t b) {
  asm volatile("st.volatile.global.v2.u32 [%0], {%1, %2};" ::"l"(p), "r"(a), "r"(b) : "memory");
}

__device__ __forceinline__ uint4 ld_volatile_v4(const uint4* p) {
  uint4 v;
  asm volatile("ld.volatile.global.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "l"(p)
               : "memory");
  return v;
}

__device__ __forceinline__ uint2 ld_volatile_v2(const uint2* p) {
  uint2 v;
  asm volatile("ld.volatile.global.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p) : "memory");
  return v;
}

// One 64-bit word, single-copy atomic (the sentinel push: a reader sees the old or the new 8 bytes).
__device__ __forceinline__ void st_volatile_u64(uint64_t* p, uint64_t v) {
  asm volatile("st.volatile.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

__device__ __forceinline__ uint64_t ld_volatile_u64(const uint64_t* p) {
  uint64_t v;
  asm volatile("ld.volatile.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
  return v;
}

// Two 64-bit elements in one 16-byte access: each element is single-copy atomic (not the pair).
__device__ __forceinline__ void st_volatile_v2u64(uint64_t* p, uint64_t a, uint64_t b) {
  asm volatile("st.volatile.global.v2.u64 [%0], {%1, %2};" ::"l"(p), "l"(a), "l"(b) : "memory");
}

__device__ __forceinline__ void ld_volatile_v2u64(const uint64_t* p, uint64_t& a, uint64_t& b) {
  asm volatile("ld.volatile.global.v2.u64 {%0, %1}, [%2];" : "=l"(a), "=l"(b) : "l"(p) : "memory");
}

// Record a timed-out wait. Plain volatile stores, no atomics: atomics on pinned host memory are not
// native over PCIe. Two waits expiring at once may interleave their fields; the word stays "set".
// The fields are written before the "set" word [0].
__device__ __forceinline__ void report_timeout(int64_t* err, int rank, int peer, int mech, int64_t value) {
  if (err == nullptr) return;
  volatile int64_t* e = err;
  if (e[7] != 0) return;  // an earlier timeout is already recorded
  e[7] = 1;
  e[1] = rank;
  e[2] = peer;
  e[3] = mech;
  e[4] = value;
  __threadfence_system();
  e[0] = 1;
}

// A thread's bounded poll: until `here()`, `reload()` what it waits for and look again, reading the clock every
// 64 misses; gives up once `timeout_ns` have passed since the first miss. The caller checks here() after it
// (false: timed out; it records the error and skips the data). The Output LL128 LSE settle and sentinel waits;
// the LL kernel's wait (output/flag_in_data.cuh) has the same shape but stays written out: through this helper its
// kernel compiles differently and measured 2-5 % slower at T = 4-8 (A/B/A/B in separate processes).
template <typename Here, typename Reload>
__device__ __forceinline__ void spin_until(int64_t timeout_ns, Here here, Reload reload) {
  const uint64_t t0 = global_timer_ns();
  int spins = 0;
  while (!here()) {
    reload();
    if (!here() && ++spins == 64) {
      spins = 0;
      if (static_cast<int64_t>(global_timer_ns() - t0) > timeout_ns) break;
    }
  }
}

// Bounded acquire poll of an int64 flag until it equals `value`. Returns false after `timeout_ns`
// (and records the error): the caller must then skip the data it waited for. Never traps.
__device__ __forceinline__ bool wait_equal_sys(const int64_t* flag, int64_t value, int64_t timeout_ns, int64_t* err,
                                               int rank, int peer, int mech) {
  if (ld_acquire_sys(flag) == value) return true;
  const uint64_t t0 = global_timer_ns();
  while (true) {
    for (int i = 0; i < 64; ++i) {
      if (ld_acquire_sys(flag) == value) return true;
    }
    if (static_cast<int64_t>(global_timer_ns() - t0) > timeout_ns) break;
  }
  if (ld_acquire_sys(flag) == value) return true;
  report_timeout(err, rank, peer, mech, value);
  return false;
}

// 8 x 16-bit floats <-> 8 floats (bf16 or fp16 payloads travel as uint4). Pure bit operations on the
// four 32-bit words, so the vectors stay in registers (no address is taken).
template <typename T>
struct Pack8;

template <>
struct Pack8<__nv_bfloat16> {
  static __device__ __forceinline__ float lo(uint32_t w) { return __uint_as_float(w << 16); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __uint_as_float(w & 0xffff0000u); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    return uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(a))) |
           (uint32_t(__bfloat16_as_ushort(__float2bfloat16_rn(b))) << 16);
  }
  static __device__ __forceinline__ void to_float(const uint4 v, float f[8]) {
    f[0] = lo(v.x), f[1] = hi(v.x), f[2] = lo(v.y), f[3] = hi(v.y);
    f[4] = lo(v.z), f[5] = hi(v.z), f[6] = lo(v.w), f[7] = hi(v.w);
  }
  static __device__ __forceinline__ uint4 from_float(const float f[8]) {
    return make_uint4(pack(f[0], f[1]), pack(f[2], f[3]), pack(f[4], f[5]), pack(f[6], f[7]));
  }
};

template <>
struct Pack8<__half> {
  static __device__ __forceinline__ float lo(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w & 0xffffu))); }
  static __device__ __forceinline__ float hi(uint32_t w) { return __half2float(__ushort_as_half(uint16_t(w >> 16))); }
  static __device__ __forceinline__ uint32_t pack(float a, float b) {
    return uint32_t(__half_as_ushort(__float2half_rn(a))) | (uint32_t(__half_as_ushort(__float2half_rn(b))) << 16);
  }
  static __device__ __forceinline__ void to_float(const uint4 v, float f[8]) {
    f[0] = lo(v.x), f[1] = hi(v.x), f[2] = lo(v.y), f[3] = hi(v.y);
    f[4] = lo(v.z), f[5] = hi(v.z), f[6] = lo(v.w), f[7] = hi(v.w);
  }
  static __device__ __forceinline__ uint4 from_float(const float f[8]) {
    return make_uint4(pack(f[0], f[1]), pack(f[2], f[3]), pack(f[4], f[5]), pack(f[6], f[7]));
  }
};

// DCP token ownership (DESIGN.md section 3, reference.local_length): how many of a sequence's tokens 0 .. L-1 rank
// `rank` of W owns when runs of I consecutive tokens go round-robin over the ranks (L >= 0). One 32-bit division
// where L and I * W fit (always, for valid lengths): a 64-bit division is ~20 instructions behind a run-time check
// for 32-bit operands, on the latency path of the kernels' starts (the Top-K selection's 2K / 4K rows took 0.4-0.5
// us less without it). The Top-K selection and the indexer scan both mask by it.
__device__ __forceinline__ int64_t local_length(int64_t L, int rank, int W, int I) {
  const int64_t IW = static_cast<int64_t>(I) * W;
  int64_t q = 0, rem = 0;
  if (L > 0 && L <= 0x7fffffff && IW <= 0x7fffffff) {
    const uint32_t q32 = static_cast<uint32_t>(L) / static_cast<uint32_t>(IW);
    q = q32, rem = static_cast<uint32_t>(L) - q32 * static_cast<uint32_t>(IW);
  } else if (L > 0) {
    q = L / IW, rem = L % IW;
  }
  rem -= static_cast<int64_t>(rank) * I;
  rem = rem < 0 ? 0 : (rem > I ? I : rem);
  return q * I + rem;
}

// #{y in list[0, n) : y > x} for an int64 list sorted descending: the first index whose key is <= x (a binary
// search; the Top-K merge and the local selection rank candidate keys with it).
__device__ __forceinline__ int count_greater(const int64_t* list, int n, int64_t x) {
  int lo = 0, hi = n;
  while (lo < hi) {
    const int mid = (lo + hi) >> 1;
    if (list[mid] > x)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

}  // namespace peerdcp
