"""The Query gather's exchange policy (``peerdcp.query.gather.copy_mode``): which kernel mode a call of T
tokens runs, for each exchange and object kind. Pure host logic, no ranks."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

from peerdcp.query import gather as G
from peerdcp.query import kernels as K


@pytest.mark.parametrize("T", [1, 2, 8, 9, 16, 63, 64, 65, 256])
def test_auto_with_push_slots_and_ll(T):
    # W = 2 FP8 on the CUDA kernel: LL push up to the LL bound, the fenced push above
    mode = G.copy_mode("auto", T, push_slots=True, ll_max=64)
    assert mode == (K.MODE_PUSH_LL if T <= 64 else K.MODE_PUSH)


@pytest.mark.parametrize("T", [1, 8, 9, 32, 33, 256])
def test_auto_without_push_slots(T):
    # W = 2 BF16 on the CUDA kernel (LL bound 32): LL push, then roped; Triton (no LL): raw <= 8, then roped
    assert G.copy_mode("auto", T, push_slots=False, ll_max=32) == (K.MODE_PUSH_LL if T <= 32 else K.MODE_ROPED)
    raw = T <= G.AUTO_RAW_MAX_TOKENS
    assert G.copy_mode("auto", T, push_slots=False, ll_max=0) == (K.MODE_RAW if raw else K.MODE_ROPED)


def test_auto_triton_with_push_slots_is_push_everywhere():
    assert {G.copy_mode("auto", T, push_slots=True, ll_max=0) for T in range(1, 300)} == {K.MODE_PUSH}


def test_auto_push_raw_bound_comes_first(monkeypatch):
    monkeypatch.setattr(G, "AUTO_PUSH_RAW_MAX_TOKENS", 4)
    modes = [G.copy_mode("auto", T, push_slots=True, ll_max=16) for T in (1, 4, 5, 16, 17)]
    assert modes == [K.MODE_RAW, K.MODE_RAW, K.MODE_PUSH_LL, K.MODE_PUSH_LL, K.MODE_PUSH]


@pytest.mark.parametrize("T", [1, 16, 17, 512])
def test_explicit_exchanges(T):
    assert G.copy_mode("raw", T, push_slots=True, ll_max=16) == K.MODE_RAW
    assert G.copy_mode("roped", T, push_slots=False, ll_max=16) == K.MODE_ROPED
    assert G.copy_mode("push", T, push_slots=True, ll_max=16) == (K.MODE_PUSH_LL if T <= 16 else K.MODE_PUSH)
    assert G.copy_mode("push", T, push_slots=True, ll_max=0) == K.MODE_PUSH


def test_ll_bounds_are_byte_bounds_by_dtype():
    # the defaults (tokens of 32 heads of 576): SN 256 for FP8 and BF16 (LL off; LL12 128 / 48 is below SN, so
    # never reached); LL128 off
    row = {torch.float8_e4m3fn: 32 * 576, torch.bfloat16: 32 * 576 * 2}
    keys = ("ll", "sn", "ll12")
    got = {k: {dt: G.tuning_bytes(f"cuda_{k}_max_bytes", dt) // r for dt, r in row.items()} for k in keys}
    assert got == {
        "ll": {torch.float8_e4m3fn: 0, torch.bfloat16: 0},
        "sn": {torch.float8_e4m3fn: 256, torch.bfloat16: 256},
        "ll12": {torch.float8_e4m3fn: 128, torch.bfloat16: 48},
    }
    assert G.tuning_bytes("cuda_ll128_max_bytes", torch.float8_e4m3fn) == 0
    # a plain int applies to every dtype (how tests and the benchmark switch a protocol off)
    with mock.patch.dict(G.TUNING, {"cuda_ll_max_bytes": 7}):
        assert G.tuning_bytes("cuda_ll_max_bytes", torch.bfloat16) == 7


@pytest.mark.parametrize("T", [1, 64, 65, 256, 257, 1024])
def test_auto_and_push_with_ll128(T):
    # LL up to its bound, LL128 up to its own, then the fenced push (push slots) or roped (none)
    want = K.MODE_PUSH_LL if T <= 64 else K.MODE_PUSH_LL128 if T <= 256 else None
    for ex, slots, above in (("auto", True, K.MODE_PUSH), ("auto", False, K.MODE_ROPED), ("push", True, K.MODE_PUSH)):
        assert G.copy_mode(ex, T, push_slots=slots, ll_max=64, ll128_max=256) == (want or above)
    assert G.copy_mode("roped", T, push_slots=False, ll_max=64, ll128_max=256) == K.MODE_ROPED
    assert G.copy_mode("raw", T, push_slots=True, ll_max=64, ll128_max=256) == K.MODE_RAW


@pytest.mark.parametrize("exchange", ["auto", "push"])
def test_protocols_apply_in_order_ll_ll12_ll128(exchange):
    modes = [
        G.copy_mode(exchange, T, push_slots=True, ll_max=4, ll12_max=16, ll128_max=32)
        for T in (1, 4, 5, 16, 17, 32, 33)
    ]
    assert modes == [K.MODE_PUSH_LL] * 2 + [K.MODE_PUSH_LL12] * 2 + [K.MODE_PUSH_LL128] * 2 + [K.MODE_PUSH]
    # a bound at or below an earlier one is never reached (the host passes 0 there)
    assert G.copy_mode(exchange, 3, push_slots=True, ll_max=0, ll12_max=0, ll128_max=8) == K.MODE_PUSH_LL128


@pytest.mark.parametrize("exchange", ["auto", "push"])
def test_sentinel_push_sits_between_ll_and_ll12(exchange):
    modes = [
        G.copy_mode(exchange, T, push_slots=True, ll_max=2, sn_max=8, ll12_max=16, ll128_max=32)
        for T in (1, 2, 3, 8, 9, 16, 17, 32, 33)
    ]
    want = [K.MODE_PUSH_LL] * 2 + [K.MODE_PUSH_SN] * 2 + [K.MODE_PUSH_LL12] * 2 + [K.MODE_PUSH_LL128] * 2
    assert modes == want + [K.MODE_PUSH]
    assert G.copy_mode(exchange, 5, push_slots=True, ll_max=0, sn_max=8) == K.MODE_PUSH_SN
    assert G.copy_mode("roped", 5, push_slots=False, ll_max=0, sn_max=8) == K.MODE_ROPED


def test_sentinel_bound_is_the_same_tokens_for_both_dtypes():
    # (BF16 SN sends 0xFFFF input halves as 0x7FC0, the one byte difference from the other exchanges)
    fp8, bf16 = (G.tuning_bytes("cuda_sn_max_bytes", dt) for dt in (torch.float8_e4m3fn, torch.bfloat16))
    assert bf16 == 2 * fp8 > 0


def test_sentinel_wide_stores_above_64_tokens_of_32_heads():
    # SN calls above this publish pairs of words with 16-byte stores (interleaved RoPE; measured faster from
    # T = 64 on at 32 heads, slower below)
    assert G.tuning_bytes("cuda_sn_wide_min_bytes", torch.float8_e4m3fn) // (32 * 576) == 64


def test_launch_blocks_cuts_only_sn_calls():
    # the object's grid: 528 blocks (4 per SM of 132 SMs); 32 heads per rank; (units per block, floor)
    sn = K.MODE_PUSH_SN
    assert G.launch_blocks(sn, 1, 32, 528, 0, 132) == 528  # off: the whole grid
    assert G.launch_blocks(sn, 1, 32, 528, 1, 0) == 32
    assert G.launch_blocks(sn, 1, 32, 528, 3, 0) == 11  # ceil(32 / 3)
    assert G.launch_blocks(sn, 8, 32, 528, 3, 0) == 86
    assert G.launch_blocks(sn, 64, 32, 528, 3, 0) == 528  # never above the object's grid
    # the default rule: ceil(T * H / 2), at least min(T * H, one per SM)
    want = {1: 32, 2: 64, 4: 128, 8: 132, 16: 256, 32: 512, 64: 528, 256: 528}
    assert {T: G.launch_blocks(sn, T, 32, 528, 2, 132) for T in want} == want
    for mode in (K.MODE_RAW, K.MODE_ROPED, K.MODE_PUSH, K.MODE_EXPOSED, K.MODE_PUSH_LL, K.MODE_PUSH_LL12):
        assert G.launch_blocks(mode, 1, 32, 528, 2, 132) == 528


def test_default_tuning_cuts_sn_grids():
    assert G.TUNING["cuda_sn_units_per_block"] == 2 and G.TUNING["cuda_sn_min_blocks_per_sm"] == 1


def _direct_args(t: torch.Tensor) -> tuple:
    # tensors, peer addresses, state, error word, timeout, scale, then the 20 geometry ints of ops.query_direct
    return (t, t, t, t, t, [1, 2], t, t, 0, 0, 1.0, *range(1, 21))


def test_query_ops_trace_with_fake_implementations(monkeypatch):
    """Under ``torch.compile`` (``is_compiling``) ``ops.query_direct`` / ``query_wait_acks`` go through the
    ``peerdcp::`` custom ops, which trace under FakeTensorMode without CUDA (their fake implementations); the
    eager launch functions are not called."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from peerdcp.query import ops

    seen = []
    monkeypatch.setattr(ops, "_launch_query_direct", lambda *a: seen.append("direct"))
    monkeypatch.setattr(ops, "_launch_query_wait_acks", lambda *a: seen.append("acks"))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode():
        t = torch.empty(2, 4, 8, dtype=torch.bfloat16, device="cuda")
        assert ops.query_direct(*_direct_args(t)) is None
        assert ops.query_wait_acks([1, 2], t, 0, 0, 0, 2, 4, 0) is None
    assert seen == []


def test_query_eager_calls_skip_the_dispatcher(monkeypatch):
    """Eager calls launch directly (through the custom op an eager gather took ~3.5x the host time): the launch
    functions get the op's arguments, the geometry as one list of 21 ints."""
    from peerdcp.query import ops

    seen = []
    monkeypatch.setattr(ops, "_launch_query_direct", lambda *a: seen.append(("direct", a[7], a[-1])))
    monkeypatch.setattr(ops, "_launch_query_wait_acks", lambda *a: seen.append(("acks", a[1], a[-1])))
    t = torch.empty(1)
    ops.query_direct(*_direct_args(t), 7)
    ops.query_wait_acks((3, 4), t, 0, 0, 1, 2, 4, 5)
    assert seen == [("direct", [1, 2], [*range(1, 18), 7, 18, 19, 20]), ("acks", [3, 4], [1, 2, 4, 5])]
