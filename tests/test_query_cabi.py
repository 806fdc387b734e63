"""The Query CUDA entry point's argument checks, without a GPU (needs nvcc + ninja to build the library):
bad geometry, unknown modes and an LL push call beyond its LL area are rejected with cudaErrorInvalidValue
before anything touches CUDA, the PDL bit is accepted on every valid mode, and T = 0 returns success
without a launch."""

from __future__ import annotations

import ctypes
import shutil

import pytest

from peerdcp.jit import nvcc_path
from peerdcp.query import kernels as K

pytestmark = pytest.mark.skipif(
    nvcc_path() is None or shutil.which("ninja") is None, reason="needs nvcc + ninja to build the library"
)
INVALID = 1  # cudaErrorInvalidValue


def _call(*, T=1, W=2, nope=512, rope=64, nprog=4, mode=K.MODE_RAW, ll_max=0) -> int:
    from peerdcp.query import ops

    lib = ops.load()
    peers = (ctypes.c_uint64 * 8)(*([0x1000] * 8))
    return lib.peerdcp_query_direct(
        None, None, 0, 0, 0, 0, None, 0, None, 0, None, ctypes.cast(peers, ctypes.c_void_p), None, None, None,
        10**9, 1.0, T, 0, W, 16, W * 16, nope, rope, 8, 0, 0, 0, ll_max, nprog, mode, 0, 1, 2, None,
    )  # fmt: skip


def test_bad_geometry_and_modes_rejected_before_any_cuda_call():
    assert _call(W=9) == INVALID
    assert _call(W=0) == INVALID
    assert _call(nope=500) == INVALID
    assert _call(rope=60) == INVALID
    assert _call(nprog=0) == INVALID
    assert _call(mode=5) == INVALID
    assert _call(mode=5 | K.MODE_PDL) == INVALID
    assert _call(mode=K.MODE_PUSH_LL, T=9, ll_max=8) == INVALID  # beyond the LL area
    assert _call(mode=16) == INVALID


def test_empty_call_is_a_no_op_for_every_mode_with_and_without_pdl():
    for mode in (K.MODE_RAW, K.MODE_ROPED, K.MODE_EXPOSED, K.MODE_PUSH, K.MODE_PUSH_LL):
        for pdl in (0, K.MODE_PDL):
            assert _call(T=0, mode=mode | pdl) == 0
