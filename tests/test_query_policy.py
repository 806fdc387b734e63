"""The Query gather's policy (``peerdcp.query.policy``: ``copy_mode``, the byte bounds, the launch grid): which
kernel mode a call of T tokens runs, for each exchange and object kind; and the CUDA launcher's parameter block
(``peerdcp.query.ops``). Pure host logic, no ranks."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from peerdcp.query import kernels as K
from peerdcp.query import policy as G


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


def test_auto_push_raw_bound_comes_first():
    policy = dataclasses.replace(G.DEFAULT_POLICY, auto_push_raw_max_tokens=4)
    modes = [G.copy_mode("auto", T, push_slots=True, ll_max=16, policy=policy) for T in (1, 4, 5, 16, 17)]
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
    policy = dataclasses.replace(G.DEFAULT_POLICY, cuda_ll_max_bytes=7)
    assert G.tuning_bytes("cuda_ll_max_bytes", torch.bfloat16, policy=policy) == 7
    assert policy.bytes_for("cuda_ll_max_bytes", torch.float8_e4m3fn) == 7


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
    assert G.DEFAULT_POLICY.cuda_sn_units_per_block == 2 and G.DEFAULT_POLICY.cuda_sn_min_blocks_per_sm == 1


def test_policy_is_frozen_checked_and_reads_the_environment_when_made(monkeypatch):
    with pytest.raises(dataclasses.FrozenInstanceError):
        G.DEFAULT_POLICY.cuda_pdl_max_tokens = 0  # type: ignore[misc]
    with pytest.raises(ValueError, match="gpu_impl"):
        dataclasses.replace(G.DEFAULT_POLICY, gpu_impl="torch")
    with pytest.raises(TypeError, match="cuda_sn_max_bytes"):
        dataclasses.replace(G.DEFAULT_POLICY, cuda_sn_max_bytes={"bfloat16": 1})
    monkeypatch.delenv("PEERDCP_QUERY_IMPL", raising=False)
    assert G.default_policy() == G.DEFAULT_POLICY and G.DEFAULT_POLICY.gpu_impl == "cuda"
    monkeypatch.setenv("PEERDCP_QUERY_IMPL", "triton")
    assert G.default_policy().gpu_impl == "triton"
    # the former module names keep the defaults' values
    assert (G.AUTO_RAW_MAX_TOKENS, G.AUTO_PUSH_RAW_MAX_TOKENS, G.PUSH_AUTO_MAX_GROWTH) == (8, 0, 1)


def _plan(**kw):
    policy = kw.pop("policy", G.DEFAULT_POLICY)
    args = dict(exchange="auto", impl="cuda", world_size=2, heads=32, head_dim=576, max_tokens=256)
    args.update(out_dtype=torch.float8_e4m3fn, rope_style="interleaved")
    args.update(kw)
    return G.plan_direct(policy, **args)


def test_plan_of_the_defaults():
    # W = 2, 32 heads, FP8, interleaved: SN up to 256 tokens (16-byte stores above 64), push slots, PDL T <= 32
    plan, reasons = _plan()
    assert (plan.push_slots, plan.ll_max, plan.sn_max, plan.ll12_max, plan.ll128_max) == (True, 0, 256, 0, 0)
    assert (plan.sn_wide_min, plan.pdl_max, plan.sn_upb, plan.early) == (64, 32, 2, True)
    assert reasons[0] == "PDL launch for T <= 32" and reasons[1] == "exchange auto (SN push for T <= 256, then push)"
    # BF16 at W = 2: a push slot costs two raw slots, so no push slots (roped above SN); NeoX: 8-byte SN stores
    plan, _ = _plan(out_dtype=torch.bfloat16)
    assert (plan.push_slots, plan.sn_max, plan.sn_wide_min) == (False, 256, None)
    assert _plan(rope_style="neox")[0].sn_wide_min is None
    # the Triton kernel: no flag-in-data protocol, no PDL
    plan, _ = _plan(impl="triton")
    assert (plan.sn_max, plan.ll12_max, plan.pdl_max) == (0, 0, 0)
    # SN off: LL12 up to 128 tokens (FP8)
    plan, _ = _plan(policy=dataclasses.replace(G.DEFAULT_POLICY, cuda_sn_max_bytes=0))
    assert (plan.sn_max, plan.ll12_max, plan.ll_area) == (0, 128, 128)


def test_launch_bits():
    plan, _ = _plan()
    assert G.launch_bits(plan, K.MODE_PUSH_SN, 1) == K.MODE_PDL | K.MODE_EARLY
    assert G.launch_bits(plan, K.MODE_PUSH_SN, 65) == K.MODE_PDL | K.MODE_WIDE
    assert G.launch_bits(plan, K.MODE_PUSH, 33) == 0
    assert G.launch_bits(plan, K.MODE_RAW, 32) == K.MODE_PDL


class _FakeLib:
    """Records the parameter block of each launch (no CUDA, no build)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict, int]] = []

    def _record(self, name, pp, size, stream):
        p = ctypes.cast(pp, ctypes.POINTER(ops().QueryDirectParams)).contents
        fields = {f: getattr(p, f) for f, _ in p._fields_ if f != "peer_base"}
        fields["peer_base"] = list(p.peer_base)
        self.calls.append((name, fields, size))
        return 0

    def peerdcp_query_direct(self, pp, size, stream):
        return self._record("direct", pp, size, stream)

    def peerdcp_query_wait_acks(self, pp, size, stream):
        return self._record("acks", pp, size, stream)


def ops():
    from peerdcp.query import ops as _ops

    return _ops


def _launcher(t: torch.Tensor):
    fixed = {name: i + 1 for i, name in enumerate(ops().FIXED_FIELDS)}
    return ops().DirectLauncher(peer_addrs=[11, 12], epochs=t, last_z=t, quant_scale=0.5, **fixed), fixed


def test_query_eager_launch_fills_the_block_by_name(monkeypatch):
    """Eager calls skip the dispatcher (through the custom op an eager gather took ~3.5x the host time) and pass
    the prebuilt block and its size; the custom op's own implementation rebuilds the same block. T is the call's,
    not the inputs' rows: an exposed call passes the whole exposed shard (max_tokens rows), and a T taken from its
    shape made the kernel store max_tokens rows into a T-row output."""
    lib = _FakeLib()
    monkeypatch.setattr(ops(), "load", lambda: lib)
    monkeypatch.setattr(ops(), "current_stream_handle", lambda device: 0)
    q = torch.zeros(5, 4, 16, dtype=torch.bfloat16)  # an exposed shard of 5 rows
    pos, cs, out = torch.zeros(3, dtype=torch.int64), torch.zeros(9, 64), torch.zeros(3, 8, 16)
    launcher, fixed = _launcher(torch.zeros(4, dtype=torch.int64))
    launcher(K.MODE_PUSH_SN | K.MODE_PDL, 3, q, q, pos, cs, out, 7)
    launcher.wait_acks()
    ops().query_direct(q, q, pos, cs, out, launcher._epochs, launcher._last_z, [11, 12], 0.5, launcher._fixed, 5, 2, 0)
    size = ctypes.sizeof(ops().QueryDirectParams)
    assert [(name, n) for name, _, n in lib.calls] == [("direct", size), ("acks", size), ("direct", size)]
    first, _, third = (f for _, f, _ in lib.calls)
    assert {k: first[k] for k in fixed} == fixed and first["peer_base"][:3] == [11, 12, 0]
    assert (first["T"], first["mode"], first["blocks"], first["pos64"], first["max_pos"]) == (3, 15, 7, 1, 9)
    assert first["quant_scale"] == 0.5 and first["s_nt"] == 64 and first["s_nh"] == 16
    assert {k: third[k] for k in fixed} == fixed and (third["mode"], third["T"], third["blocks"]) == (5, 2, 0)


def test_query_ops_trace_with_fake_implementations(monkeypatch):
    """Under ``torch.compile`` (``is_compiling``) the launcher calls the ``peerdcp::`` custom ops, which trace under
    FakeTensorMode without CUDA (their fake implementations): nothing is launched."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    lib = _FakeLib()
    monkeypatch.setattr(ops(), "load", lambda: lib)
    launcher, _ = _launcher(torch.zeros(4, dtype=torch.int64))
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with FakeTensorMode(allow_non_fake_inputs=True):
        t = torch.empty(2, 4, 8, dtype=torch.bfloat16, device="cuda")
        assert launcher(K.MODE_RAW, 1, t, t, t, t, t) is None
        assert launcher.wait_acks() is None
    assert lib.calls == []
