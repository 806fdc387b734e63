"""Foundation on GPUs: vmm and symm peer memory at W = 2 (skipped without two CUDA GPUs)."""

from __future__ import annotations

import pytest
from conftest import GPU_BACKEND, GPU_WORLD
from on_ranks import memory as fns

pytestmark = pytest.mark.multigpu


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_gpu_write_read_every_peer(pools, memory):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.write_read_all, 4 * 2 * 4096 + 16, memory, "cuda")
    assert res == [{"zero": True, "ok": True, "reads": True, "closed": True}] * GPU_WORLD


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_gpu_triton_kernel_roundtrip(pools, memory):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.kernel_roundtrip, 5, 1000, memory, "cuda")
    assert res == [[True] * 5] * GPU_WORLD


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_gpu_200_cycles_no_growth(pools, memory):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.gpu_cycles, memory, 200, 3 << 20)
    for r in res:
        assert r["free_drop"] <= 0, r  # no growth in device memory
        assert r["fds"][1] <= r["fds"][0], r


def test_gpu_probe(pools):
    res = pools(GPU_WORLD, GPU_BACKEND).run(fns.probe_json)
    for d in res:
        assert d["cuda"] is True
        assert d["kinds"]["vmm"]["eligible"] or d["kinds"]["symm"]["eligible"], d["kinds"]
