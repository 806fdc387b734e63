// Smallest C-ABI kernel: checks that the ninja + nvcc JIT path builds, loads and launches on a stream.
#include <cuda_runtime.h>
#include <cstdint>

__global__ void fill_kernel(int32_t* p, int64_t n, int32_t v) {
  for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
    p[i] = v + (int32_t)(i % 1000);
}

extern "C" int peerdcp_selftest_fill(int32_t* p, int64_t n, int32_t v, cudaStream_t stream) {
  if (n <= 0) return cudaSuccess;
  int blocks = (int)((n + 255) / 256);
  if (blocks > 1024) blocks = 1024;
  fill_kernel<<<blocks, 256, 0, stream>>>(p, n, v);
  return (int)cudaGetLastError();
}
