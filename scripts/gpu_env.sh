# Sourced by scripts/gpu_check.sh and scripts/ab_bench.sh (from the repository root): the environment of every
# run on the lent GPU machines. Multicast stays off on every multi-GPU run (NCCL NVLS, PyTorch symmetric memory,
# NVSHMEM): it can take the host's GPUs out of service there.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PEERDCP_CACHE="$PWD/.jitcache"
