"""Shared fixtures: rank pools (real processes + gloo) reused across tests, the GPU and nvcc markers."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from peerdcp._runtime.jit import nvcc_path
from peerdcp.harness.launch import RankPool
from peerdcp.memory.probe import ranks_share_gpus

_POOLS: dict[tuple[int, str], RankPool] = {}

#: ranks (one per GPU) of the multigpu tests: 2 by default; ``PEERDCP_GPU_WORLD=4`` (or 8) runs the same
#: suites at DCP4 / DCP8 on a host with that many GPUs (they are skipped with fewer).
GPU_WORLD = int(os.environ.get("PEERDCP_GPU_WORLD", "2"))

#: ``PEERDCP_SHARED_GPU=1`` on a host with fewer GPUs than ``max(2, GPU_WORLD)`` (with enough, it changes
#: nothing): the multigpu tests run with ranks sharing the GPUs there are (rank r on GPU r % count; the probe
#: then accepts ranks on one device). Correctness only: the ranks' processes time-slice a GPU, so each peer wait
#: lasts scheduler slices. NCCL refuses two ranks on one GPU, so the pools' device collectives (the baselines)
#: go through gloo there.
SHARED_GPU = ranks_share_gpus(max(2, GPU_WORLD))

#: the rank pools' backend of the GPU tests
GPU_BACKEND = "cpu:gloo,cuda:gloo" if SHARED_GPU else "cpu:gloo,cuda:nccl"

# Without a GPU the tests only call the CUDA libraries' host entry points: build them in host-check form
# (peerdcp._runtime.jit.host_check: unoptimized PTX, ~30 s for all five on two cores instead of ~3 min); rank processes
# inherit it.
if not torch.cuda.is_available():
    os.environ.setdefault("PEERDCP_JIT_HOST_CHECK", "1")


def replays(n: int) -> int:
    """How many graph replays a test of ``n`` replays runs: ``n``, or n / 500 (at least 16) when ranks share a
    GPU, where every peer wait lasts a scheduler slice (~50-100 ms per exchange measured on one H200)."""
    return max(16, n // 500) if SHARED_GPU else n


def get_pool(world: int, backend: str = "gloo") -> RankPool:
    key = (world, backend)
    pool = _POOLS.get(key)
    if pool is None or pool.broken:
        pool = RankPool(world, backend=backend)
        _POOLS[key] = pool
    return pool


@pytest.fixture(scope="session")
def pools():
    yield get_pool
    for p in _POOLS.values():
        if not p.broken:
            p.close()
    _POOLS.clear()


def pytest_collection_modifyitems(config, items):
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skip_cuda = pytest.mark.skip(reason="needs CUDA")
    skip_multi = pytest.mark.skip(reason=f"needs >= {GPU_WORLD} CUDA GPUs (PEERDCP_GPU_WORLD)")
    no_nvcc = nvcc_path() is None or shutil.which("ninja") is None
    for item in items:
        if "nvcc" in item.keywords and no_nvcc:
            item.add_marker(pytest.mark.skip(reason="needs nvcc + ninja to build the library"))
        if "multigpu" in item.keywords and ngpu < (1 if SHARED_GPU else max(2, GPU_WORLD)):
            item.add_marker(skip_multi)
        elif "multigpu" in item.keywords and SHARED_GPU and (why := _shared_gpu_skip(item)):
            item.add_marker(pytest.mark.skip(reason=f"ranks share a GPU (PEERDCP_SHARED_GPU): {why}"))
        elif "cuda" in item.keywords and ngpu < 1:
            item.add_marker(skip_cuda)


def _shared_gpu_skip(item) -> str:
    """Why a multigpu test cannot run with ranks sharing a GPU ("" if it can)."""
    params = getattr(getattr(item, "callspec", None), "params", {})
    if "symm" in params.values():
        return "torch symmetric memory refuses ranks on one GPU (overlapping devices)"
    if "graph_collective" in item.keywords:
        return "it captures a collective in a CUDA graph, which gloo cannot be"
    return ""


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


os.environ.setdefault("PYTHONHASHSEED", "0")
