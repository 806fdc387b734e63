"""The CUDA C++ JIT path (ninja + nvcc, C ABI, ctypes) on a GPU."""

from __future__ import annotations

import ctypes

import pytest
import torch

pytestmark = pytest.mark.cuda


def test_jit_build_and_launch():
    from peerdcp._runtime.jit import load

    lib = load("peerdcp_selftest")
    fn = lib.peerdcp_selftest_fill
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    x = torch.full((5000,), -1, dtype=torch.int32, device="cuda")
    rc = fn(x.data_ptr(), x.numel(), 7, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert rc == 0
    assert torch.equal(x.cpu(), 7 + torch.arange(5000, dtype=torch.int32) % 1000)
