"""QueryGather on CPU: real rank processes over host shared memory, the Triton kernels in the interpreter.

Direct (raw, roped, push, zero-copy) and allgather (fused Triton, plain torch) must give the same bytes as the
fp32 reference, and lie within the rounding contract's bound of the fp64 math (``widened_query_bounds``;
>= 99.9 % identical to it)."""

from __future__ import annotations

import glob

import pytest
import torch
from on_ranks import query as fns

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16

CASES = {
    # FP8, MLA RoPE over the whole DeepSeek-V3.2 YaRN table (positions 0 and 163839 included)
    "fp8-interleaved-dsv32": dict(style="interleaved", out=FP8, table="deepseek-v3.2"),
    # FP8 with a quant scale, NeoX pairs, zero padding to 64 heads, int32 positions
    "fp8-neox-scale-pad64": dict(style="neox", out=FP8, scale=0.5, pad=64, pos32=True),
    # BF16 over the Kimi-K2 table, and NeoX with padding
    "bf16-interleaved-kimi": dict(style="interleaved", out=BF16, table="kimi-k2"),
    "bf16-neox-pad64": dict(style="neox", out=BF16, pad=64),
    # beyond +-448 / scale (and +-inf): saturates, never NaN
    "fp8-saturation": dict(style="interleaved", out=FP8, scale=2.0, mag=300.0, specials=True),
    # a smaller head geometry, one token
    "fp8-small-T1": dict(style="interleaved", out=FP8, nope=64, rope=16, T=1, H=5),
}


def test_interpreter_conversions_match_torch(pools):
    for r in pools(2).run(fns.kernel_numerics):
        assert r["fp8_mismatch"] == 0 and r["bf16_mismatch"] == 0, r
        assert r["fp8_nan_is_nan"] and r["bf16_nan_is_nan"], r


@pytest.mark.parametrize(
    "world,names",
    [
        (2, list(CASES)),
        (3, ["fp8-neox-scale-pad64", "bf16-interleaved-kimi"]),
        (4, ["fp8-interleaved-dsv32"]),
    ],
    ids=["w2-all", "w3", "w4"],
)
def test_direct_and_allgather_byte_identical(pools, world, names):
    res = pools(world).run(fns.gather_matrix, [CASES[n] for n in names], H=3, T=4)
    for r in res:
        fns.check_matrix(r, names, "host")


@pytest.mark.parametrize("world", [2, 3])
def test_50_back_to_back_calls_without_barrier(pools, world):
    """W = 3 as well: no FP8 push slots there (raw copy calls), and three ranks on a 2-core CI machine drift apart
    more. A one-slot kernel still passes both (the interpreter runs a grid's programs in order, so only a call's
    first program could overrun a peer's last one); the GPU back-to-back test catches that (mutants.py --gpu)."""
    res = pools(world).run(fns.back_to_back, 50, raw_max=3)
    for r in res:
        assert r["bad"] == [], r
        assert r["backend"] == "direct" and r["calls"] == 50, r
        assert r["exposed"] > 10 and min(r["tokens"]) == 1 and max(r["tokens"]) > 4, r
        # the exchanges share the parity slots (W > 2: no FP8 push slots, the copy calls are raw)
        assert r["modes"] == (["exposed", "push", "raw"] if world == 2 else ["exposed", "raw"]), r


def test_bad_inputs_raise_before_launch(pools):
    res = pools(2).run(fns.bad_inputs)
    for rank, r in enumerate(res):
        assert r["good_after"], r
        for name, msg in r["errors"].items():
            if name == "ctor one bad rank":
                want = "ValueError" if rank == 1 else "PeerSetupError"
                assert msg.startswith(want) and "rope_dim" in msg, (name, msg)
                continue
            assert msg.startswith(("ValueError", "TypeError")), (name, msg)
        e = r["errors"]
        assert "heads_per_rank must be the same on every rank" in e["ctor mismatched heads"]
        assert "positions must be in [0, 64)" in e["call positions range"]
        assert "16-byte" in e["call q_nope stride"] and "contiguous last dim" in e["call q_nope last dim"]
        assert "max_tokens = 4" in e["call T > max_tokens"]
        assert "exposed_shard(T) first" in e["call gather_exposed first"]
        assert "closed" in e["closed call"]
        assert "at most 1e+06 seconds" in e["ctor timeout_s inf"] and "at most" in e["ctor timeout_s past the bound"]
        assert "finite in fp32" in e["ctor quant_scale inf in fp32"] and "fp32" in e["ctor quant_scale 0 in fp32"]
        assert e["ctor pad_heads_to=64.0"].startswith("TypeError"), e["ctor pad_heads_to=64.0"]


def test_missing_peer_raises_timeout(pools):
    res = pools(2).run(fns.missing_peer, 1, 1.5)
    assert res[1]["role"] == "absent"
    r = res[0]
    assert r["first"] == "rank=0 peer=1 mech=query", r
    assert r["check"] == r["again"] == r["exposed"] == r["first"], r
    assert 0.3 < r["dt"] < 4 * 1.5, r  # ~ the 1.5 s timeout once, not once per program of the grid


def test_create_close_cycles_leave_nothing(pools):
    res = pools(2).run(fns.lifecycle, 12)
    for r in res:
        assert r["after"]["maps"] == r["before"]["maps"] == 0 and r["after"]["shm"] == 0, r
        assert r["after"]["fds"] <= r["before"]["fds"], r
        assert ("allgather", None, "triton", True) in r["kinds"] and ("direct", "host", "triton", True) in r["kinds"]
        assert r["auto"][:4] == ("direct", "host", "triton", "auto") and "host" in r["auto"][4], r
        assert r["closed"]
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_bf16_subnormal_pe_exact_on_cpu(pools):
    """q_pe of bf16 subnormals, BF16 output: every CPU path equals the reference bit for bit (a wrong bf16 ->
    fp32 widening of subnormals in the interpreter makes most rotated elements differ, by up to 88 bf16 steps)."""
    for r in pools(2).run(fns.subnormal_pe):
        assert r == {"ref32 == ref64": True, "direct raw": 0, "direct push": 0, "allgather None": 0}, r
