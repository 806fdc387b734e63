"""The Query CUDA entry points' argument checks, without a GPU (needs nvcc + ninja to build the library): a
parameter block of another size than ``QueryDirectParams``, bad geometry, unknown modes, the early bit on any mode
but LL / SN push, the wide bit on anything but FP8 interleaved SN, an LL / LL128 / SN push call beyond its area, a
launch grid ("blocks") beyond the object's or below it for a mode with flags are rejected with
cudaErrorInvalidValue before anything touches CUDA, the PDL bit is accepted on every valid mode, and T = 0 returns
success without a launch."""

from __future__ import annotations

import ctypes

import pytest

from peerdcp.query import kernels as K

pytestmark = pytest.mark.nvcc
INVALID = 1  # cudaErrorInvalidValue


def _params(*, T=1, W=2, nope=512, rope=64, nprog=4, mode=K.MODE_RAW, ll_max=0, ll128_lines=0, fp8=1, sn_max=0,
            neox=0, blocks=0):  # fmt: skip
    from peerdcp.query import ops

    p = ops.QueryDirectParams()
    for r in range(8):
        p.peer_base[r] = 0x1000
    p.timeout_ns, p.quant_scale, p.max_tokens, p.mech = 10**9, 1.0, 8, 2
    p.T, p.rank, p.W, p.H, p.HOUT, p.NOPE, p.ROPE = T, 0, W, 16, W * 16, nope, rope
    p.ll_max_tokens, p.ll128_lines, p.sn_max_tokens = ll_max, ll128_lines, sn_max
    p.nprog, p.blocks, p.mode, p.neox, p.fp8 = nprog, blocks, mode, neox, fp8
    return p


def _call(**kw) -> int:
    from peerdcp.query import ops

    p = _params(**kw)
    return ops.load().peerdcp_query_direct(ctypes.byref(p), ctypes.sizeof(p), None)


def test_parameter_block_of_another_size_is_rejected():
    from peerdcp.query import ops

    lib = ops.load()  # (checks peerdcp_query_params_size against the mirror)
    p = _params(T=0)
    for entry in (lib.peerdcp_query_direct, lib.peerdcp_query_wait_acks):
        assert entry(ctypes.byref(p), ctypes.sizeof(p) - 8, None) == INVALID
        assert entry(ctypes.byref(p), ctypes.sizeof(p) + 8, None) == INVALID
        assert entry(None, ctypes.sizeof(p), None) == INVALID
    assert lib.peerdcp_query_direct(ctypes.byref(p), ctypes.sizeof(p), None) == 0  # T = 0: no launch
    bad = _params(W=9)
    assert lib.peerdcp_query_wait_acks(ctypes.byref(bad), ctypes.sizeof(bad), None) == INVALID
    bad = _params(nprog=0)
    assert lib.peerdcp_query_wait_acks(ctypes.byref(bad), ctypes.sizeof(bad), None) == INVALID


def test_bad_geometry_and_modes_rejected_before_any_cuda_call():
    assert _call(W=9) == INVALID
    assert _call(W=0) == INVALID
    assert _call(nope=500) == INVALID
    assert _call(rope=60) == INVALID
    assert _call(nprog=0) == INVALID
    assert _call(mode=32) == INVALID  # no such mode bit
    assert _call(mode=32 | K.MODE_PDL) == INVALID
    assert _call(mode=K.MODE_PUSH_LL, T=9, ll_max=8) == INVALID  # beyond the LL area
    assert _call(mode=K.MODE_PUSH_LL12, T=9, ll_max=8) == INVALID
    # LL12 needs rows of whole 24-byte triples: D * osize = 560 (FP8) / 1120 (BF16) is not
    assert _call(mode=K.MODE_PUSH_LL12, nope=496, ll_max=8) == INVALID
    assert _call(mode=K.MODE_PUSH_LL12, nope=496, ll_max=8, fp8=0) == INVALID
    # LL128: one token of 16 heads x 576 FP8 bytes is 1152 words, 77 lines (BF16: 154)
    assert _call(mode=K.MODE_PUSH_LL128, T=1, ll128_lines=76) == INVALID
    assert _call(mode=K.MODE_PUSH_LL128, T=1, ll128_lines=153, fp8=0) == INVALID
    assert _call(mode=K.MODE_PUSH_LL128, T=2, ll128_lines=153) == INVALID
    for mode in (K.MODE_EARLY, K.MODE_RAW | K.MODE_EARLY, K.MODE_PUSH | K.MODE_EARLY, K.MODE_PUSH_LL128 | 16):
        assert _call(mode=mode, ll_max=8, ll128_lines=1000) == INVALID  # the early bit is for LL / SN push only
    # SN: at most sn_max_tokens rows (FP8 or BF16)
    assert _call(mode=K.MODE_PUSH_SN, T=9, sn_max=8) == INVALID
    assert _call(mode=K.MODE_PUSH_SN, T=9, sn_max=8, fp8=0) == INVALID
    assert _call(mode=K.MODE_PUSH_SN | K.MODE_EARLY, T=9, sn_max=8) == INVALID
    # the wide bit (16-byte SN stores): FP8 SN with interleaved RoPE only, never with the early bit
    wide = K.MODE_PUSH_SN | K.MODE_WIDE
    assert _call(mode=wide, T=1, sn_max=8, fp8=0) == INVALID
    assert _call(mode=wide, T=9, sn_max=8) == INVALID
    assert _call(mode=wide | K.MODE_EARLY, T=1, sn_max=8) == INVALID
    assert _call(mode=wide, T=1, sn_max=8, neox=1) == INVALID
    for mode in (K.MODE_PUSH_LL, K.MODE_PUSH, K.MODE_RAW):
        assert _call(mode=mode | K.MODE_WIDE, T=1, ll_max=8) == INVALID
    # blocks (this launch's grid): 0 = nprog; between 1 and nprog; below nprog only for the flag-free push modes,
    # whose blocks wait for no twin block's flag
    assert _call(blocks=-1) == INVALID
    assert _call(blocks=5, nprog=4) == INVALID
    for mode in (K.MODE_RAW, K.MODE_ROPED, K.MODE_EXPOSED, K.MODE_PUSH):
        assert _call(mode=mode, blocks=2, nprog=4) == INVALID
    for mode in (K.MODE_PUSH_LL, K.MODE_PUSH_LL12, K.MODE_PUSH_LL128, K.MODE_PUSH_SN, K.MODE_PUSH_SN | K.MODE_WIDE):
        assert _call(T=0, mode=mode, blocks=2, nprog=4, ll_max=8, sn_max=8) == 0  # accepted (T = 0: no launch)
        assert _call(T=0, mode=mode, blocks=4, nprog=4, ll_max=8, sn_max=8) == 0


def test_empty_call_is_a_no_op_for_every_mode_with_and_without_pdl():
    modes = (K.MODE_RAW, K.MODE_ROPED, K.MODE_EXPOSED, K.MODE_PUSH, K.MODE_PUSH_LL, K.MODE_PUSH_LL128, K.MODE_PUSH_LL12)
    extra = (K.MODE_PUSH_SN, K.MODE_PUSH_SN | K.MODE_WIDE, K.MODE_PUSH_LL | K.MODE_EARLY, K.MODE_PUSH_SN | K.MODE_EARLY)
    for mode in modes + extra:
        for pdl in (0, K.MODE_PDL):
            assert _call(T=0, mode=mode | pdl) == 0
