"""peerdcp._runtime.jit's host-check builds (no GPU needed): the flags they use and the refusal on a GPU machine."""

from __future__ import annotations

from unittest import mock

import pytest

from peerdcp._runtime import jit


def test_host_check_flags_stop_at_unoptimized_ptx(monkeypatch):
    monkeypatch.setenv("PEERDCP_NVCC_EXTRA", "-DX=1")
    monkeypatch.setenv("PEERDCP_JIT_HOST_CHECK", "0")
    for name, (_, flags) in jit.LIBRARIES.items():
        assert jit._flags(flags) == (*flags, "-DX=1"), name
    monkeypatch.setenv("PEERDCP_JIT_HOST_CHECK", "1")
    for name, (_, flags) in jit.LIBRARIES.items():
        got = jit._flags(flags)
        assert got[-3:] == ("-Xcicc", "-O0", "-DX=1"), name
        gencode = [f for f in got if f.startswith("-gencode=")]
        assert gencode and all("code=sm_" not in f and ",code=compute_" in f for f in gencode), (name, gencode)
        assert [f for f in got if not f.startswith("-gencode=")][:-3] == [
            f for f in flags if not f.startswith("-gencode=")
        ], name
    # a different cache entry from the full build's
    _, flags = jit.LIBRARIES["peerdcp_output"]
    full = jit._target("peerdcp_output", ("output/direct.cu",), flags)[1]
    host = jit._target("peerdcp_output", ("output/direct.cu",), jit._flags(flags))[1]
    assert full != host


def test_host_check_build_refused_where_a_gpu_is_visible(monkeypatch):
    monkeypatch.setenv("PEERDCP_JIT_HOST_CHECK", "1")
    with mock.patch("torch.cuda.is_available", return_value=True), pytest.raises(jit.JitError, match="HOST_CHECK"):
        jit.load("peerdcp_output")


def test_param_block_size_mismatch_is_refused_at_load():
    """Every launcher takes one parameter block; a C block of another size than its ctypes mirror (a field added
    on one side only) is refused before any launch, and the entries are declared (block, size, stream)."""
    import ctypes

    class Mirror(ctypes.Structure):
        _fields_ = [("a", ctypes.c_int64), ("b", ctypes.c_int32)]

    class FakeLib:
        def __init__(self, size: int) -> None:
            self.size_fn = lambda: size
            self.launch = lambda *a: 0

    jit.bind_param_block(FakeLib(ctypes.sizeof(Mirror)), ("launch",), "size_fn", Mirror)
    good = FakeLib(16)
    jit.bind_param_block(good, ("launch",), "size_fn", Mirror)
    assert good.launch.argtypes == [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    for bad in (12, 24):
        with pytest.raises(RuntimeError, match=r"C Mirror is \d+ bytes, its ctypes mirror .* 16"):
            jit.check_param_block(FakeLib(bad), "size_fn", Mirror)
