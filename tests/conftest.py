"""Shared fixtures: rank pools (real processes + gloo) reused across tests, GPU markers."""

from __future__ import annotations

import os

import pytest
import torch

from peerdcp.launch import RankPool

_POOLS: dict[tuple[int, str], RankPool] = {}

#: ranks (one per GPU) of the multigpu tests: 2 by default; ``PEERDCP_GPU_WORLD=4`` (or 8) runs the same
#: suites at DCP4 / DCP8 on a host with that many GPUs (they are skipped with fewer).
GPU_WORLD = int(os.environ.get("PEERDCP_GPU_WORLD", "2"))


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
    for item in items:
        if "multigpu" in item.keywords and ngpu < max(2, GPU_WORLD):
            item.add_marker(skip_multi)
        elif "cuda" in item.keywords and ngpu < 1:
            item.add_marker(skip_cuda)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(1234)
    yield


os.environ.setdefault("PYTHONHASHSEED", "0")
