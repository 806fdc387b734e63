"""QueryGather on two GPUs (multigpu; skipped without them): vmm and symm memory, the CUDA and Triton
direct kernels and the allgather baselines, eager and CUDA graphs with 10,000 replays.

Run on the 2-GPU machine:  python -m pytest -q tests/test_query_gpu.py
"""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import GPU_BACKEND, GPU_WORLD
from on_ranks import query as fns

from peerdcp.query import kernels as K
from peerdcp.query.policy import DEFAULT_POLICY

pytestmark = pytest.mark.multigpu

FP8, BF16 = torch.float8_e4m3fn, torch.bfloat16

# the padded cases: W * PH widened heads padded to PAD (pad_heads_to is 64 or 128, FlashMLA's head counts): 32 -> 64
# at W = 2 (as they always had), 64 -> 128 at W = 4 and, with 8 heads per rank, at W = 8
PH = 16 if GPU_WORLD * 16 < 128 else 8
PAD = 64 if GPU_WORLD * PH < 64 else 128
GPU_CASES = {
    "fp8-interleaved-T1-H32": dict(style="interleaved", out=FP8, table="deepseek-v3.2", T=1, H=32),
    "fp8-interleaved-T256-H32": dict(style="interleaved", out=FP8, table="deepseek-v3.2", T=256, H=32),
    # positions outside the table (-7, max_pos, max_pos + 100000; int32 and int64): clamped into it
    "fp8-interleaved-T9-H8-oob": dict(style="interleaved", out=FP8, T=9, H=8, oob=True),
    "bf16-neox-T6-H8-oob-pos32": dict(style="neox", out=BF16, T=6, H=8, oob=True, pos32=True),
    # rope_dim 512, beyond the 256 dims the CUDA kernel stages per block: it reads each cos/sin row from the table
    # per use (CosSin::row, csrc/query/params.cuh), which clamps the position on its own
    "fp8-interleaved-T5-H2-rope512-oob": dict(style="interleaved", out=FP8, T=5, H=2, rope=512, oob=True),
    f"fp8-neox-scale-T37-H{PH}-pad{PAD}": dict(style="neox", out=FP8, scale=0.5, pad=PAD, T=37, H=PH, pos32=True),
    f"bf16-interleaved-T64-H{PH}-pad{PAD}": dict(style="interleaved", out=BF16, table="kimi-k2", T=64, H=PH, pad=PAD),
    "bf16-neox-T5-H64": dict(style="neox", out=BF16, T=5, H=64),
    "fp8-saturation-T9-H8": dict(style="interleaved", out=FP8, scale=2.0, mag=300.0, specials=True, T=9, H=8),
}


@pytest.fixture(scope="module")
def gpool(pools):
    return pools(GPU_WORLD, GPU_BACKEND)


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_gpu_byte_identical_all_paths(gpool, memory):
    names = list(GPU_CASES)
    res = gpool.run(fns.gather_matrix, [GPU_CASES[n] for n in names], memory=memory, impls=("cuda", "triton"))
    for r in res:
        fns.check_matrix(r, names, memory, impls=("cuda", "triton"))


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_gpu_byte_identical_cuda_paths(gpool, memory):
    """The matrix with the CUDA direct kernel only (raw / roped / push / exposed against both allgather
    paths and the fp32 reference, every case: NeoX, bf16, padding, saturation)."""
    names = list(GPU_CASES)
    res = gpool.run(fns.gather_matrix, [GPU_CASES[n] for n in names], memory=memory, impls=("cuda",), timeout=300)
    for r in res:
        fns.check_matrix(r, names, memory, impls=("cuda",))


@pytest.mark.parametrize(
    "impl,exchange",
    [(i, e) for i in ("cuda", "triton") for e in ("raw", "roped", "push", "exposed")]
    + [("triton", "allgather"), ("torch", "allgather")],
)
def test_gpu_each_path_T256_H32(gpool, impl, exchange):
    """The matrix's largest case path by path with a 5 s peer timeout, so a stalled path is named (the
    whole matrix can stall on one path while each of its other cases is byte-identical)."""
    case = dict(GPU_CASES["fp8-interleaved-T256-H32"], table="deepseek-v3.2")
    for r in gpool.run(fns.one_path, case, impl, exchange, "vmm", timeout=120):
        assert r["error"] is None and r["ok"], r
        assert r["seconds"] < 20, r


GRAPH_MODES = ["raw", "roped", "push", "push_plain", "exposed"]


@pytest.mark.parametrize(
    "memory,impl,mode",
    [(m, i, x) for m in ("vmm", "symm") for i in ("cuda", "triton") for x in GRAPH_MODES]
    + [(m, "cuda", x) for m in ("vmm", "symm") for x in ("push_ll12", "push_ll128", "push_sn", "push_sn16")]
    + [(m, "cuda", x) for m in ("vmm", "symm") for x in ("push_sn_u3", "push_sn_whole")],
)
def test_gpu_graph_10000_replays_changing_inputs(gpool, memory, impl, mode):
    replays = conftest.replays(10_000)
    res = gpool.run(fns.gpu_graph, memory, impl, mode, replays, timeout=900)
    for r in res:
        assert r["eager_ok"] and r["bad"] == 0 and r["replays"] == replays, r
        assert r["impl"] == impl and r["memory"] == memory, r
        if mode == "push":  # T = 8: the CUDA kernel's LL protocol (the Triton twin has none)
            assert r["copy_mode"] == (K.MODE_PUSH_LL if impl == "cuda" else K.MODE_PUSH), r
        if mode == "push_ll128":
            assert r["copy_mode"] == K.MODE_PUSH_LL128, r
        if mode == "push_ll12":
            assert r["copy_mode"] == K.MODE_PUSH_LL12, r
        if mode.startswith("push_sn"):  # CUDA only, as LL12 / LL128
            assert r["copy_mode"] == K.MODE_PUSH_SN and r["wide"] == (mode == "push_sn16"), r
        # T = 8 x 16 heads = 128 units: the default launches 128 blocks (64, but at least one per SM or unit),
        # push_sn_u3 43, push_sn_whole the object's grid
        want = {"push_sn": 128, "push_sn_u3": 43, "push_sn_whole": r["nprog"]}
        if mode in want:
            assert r["blocks"] == want[mode] and r["nprog"] > 128, r
        if mode == "push_plain":
            assert r["copy_mode"] == K.MODE_PUSH, r


def test_gpu_graph_10000_replays_bf16_sentinel_push(gpool):
    replays = conftest.replays(10_000)
    for r in gpool.run(fns.gpu_graph, "vmm", "cuda", "push_sn", replays, out_dtype=BF16, timeout=900):
        assert r["eager_ok"] and r["bad"] == 0 and r["replays"] == replays, r
        assert r["copy_mode"] == K.MODE_PUSH_SN and not r["wide"], r


def test_gpu_bf16_sentinel_push_rest_pattern_inputs(gpool):
    for r in gpool.run(fns.sn_bf16_nan_halves):
        assert r["mode"] == K.MODE_PUSH_SN and r["rest_halves"] > 0, r
        assert r["equal"], r


@pytest.mark.parametrize("impl", ["cuda", "triton"])
def test_gpu_back_to_back_eager(gpool, impl):
    # raw for T <= 8, then push: with the CUDA kernel LL up to 12, SN up to 18 (16-byte stores above 15), LL12
    # up to 24, LL128 up to 32, the fenced push above; every third call zero-copy; one object, no barrier
    # (W > 2: FP8 push slots would cost W / 2 raw slots, so auto has none: roped above LL128, raw_max unused)
    kw = dict(H=16, max_T=48, impl=impl, memory="vmm", raw_max=8, ll_max=12, sn_max=18, ll12_max=24, ll128_max=32)
    for r in gpool.run(fns.back_to_back, 200, sn_wide_min=15, **kw):
        print({k: r[k] for k in ("t_calls_s", "t_check_s", "slowest_calls")})  # pytest -rP shows it
        assert r["bad"] == [] and r["impl"] == impl, r
        assert r["modes"] == _b2b_modes(impl), r


def _b2b_modes(impl: str) -> list[str]:
    """The exchanges the back-to-back mix must use at GPU_WORLD (FP8; bounds as in the tests below)."""
    push_slots = DEFAULT_POLICY.push_auto_max_growth >= GPU_WORLD * 1 / 2  # FP8 push slot = W / 2 raw slots
    above = ["push", "raw"] if push_slots else ["roped"]  # the fenced push (raw at T <= 8) or roped
    if impl == "triton":
        return sorted(["exposed", *above] + ([] if push_slots else ["raw"]))
    return sorted(["exposed", "push_ll", "push_ll12", "push_ll128", "push_sn", "push_sn16", *above])


@pytest.mark.parametrize("units", [0, 3])
def test_gpu_back_to_back_eager_sn_grid(gpool, units):
    """The back-to-back mix (test_gpu_back_to_back_eager: its SN calls cut the grid by the default rule) with
    the SN calls on the object's whole grid (0) or on ceil(T * H / 3) blocks, no floor; the LL, LL12, LL128,
    fenced push, raw and zero-copy calls between them launch the whole grid, whose call counters the cut SN
    calls keep counting."""
    kw = dict(H=16, max_T=48, impl="cuda", memory="vmm", raw_max=8, ll_max=12, sn_max=18, ll12_max=24, ll128_max=32)
    tuning = {"cuda_sn_units_per_block": units, "cuda_sn_min_blocks_per_sm": 0}
    for r in gpool.run(fns.back_to_back, 200, sn_wide_min=15, tuning=tuning, **kw):
        assert r["bad"] == [], r
        assert r["modes"] == _b2b_modes("cuda"), r


def test_gpu_back_to_back_eager_bf16_auto(gpool):
    """BF16 at W = 2 has no push slots: auto sends LL, SN, LL12 and LL128 push within their bounds and roped
    above; with zero-copy calls mixed in, one object, no barrier."""
    kw = dict(H=16, max_T=48, impl="cuda", memory="vmm", ll_max=8, sn_max=16, ll12_max=24, ll128_max=32)
    for r in gpool.run(fns.back_to_back, 200, out_dtype=BF16, **kw):
        assert r["bad"] == [] and r["impl"] == "cuda", r
        assert r["modes"] == ["exposed", "push_ll", "push_ll12", "push_ll128", "push_sn", "roped"], r


@pytest.mark.parametrize(
    "impl,tuning,mode",
    [
        ("cuda", fns.CUDA_PUSH["push"], K.MODE_PUSH_LL),
        ("cuda", fns.CUDA_PUSH["push_ll128"], K.MODE_PUSH_LL128),
        ("cuda", fns.CUDA_PUSH["push_ll12"], K.MODE_PUSH_LL12),
        ("cuda", fns.CUDA_PUSH["push_sn"], K.MODE_PUSH_SN),
        ("cuda", fns.CUDA_PUSH["push_sn16"], K.MODE_PUSH_SN),
        ("triton", {}, K.MODE_PUSH),
    ],
    ids=["cuda_ll", "cuda_ll128", "cuda_ll12", "cuda_sn", "cuda_sn16", "triton"],
)
def test_gpu_missing_peer_times_out(gpool, impl, tuning, mode):
    res = gpool.run(fns.missing_peer, 1, 2.0, "vmm", impl, tuning)
    assert res[1]["role"] == "absent"
    # the Triton twin's auto exchange: push at W = 2; at W > 2 an FP8 push slot would cost W / 2 raw slots, so
    # T = 2 goes raw (the CUDA cases force push through their tuning)
    if impl == "triton" and DEFAULT_POLICY.push_auto_max_growth < GPU_WORLD / 2:
        mode = K.MODE_RAW
    for rank, r in enumerate(res):  # every present rank times out (at W > 2 possibly on a late present peer)
        if rank == 1:
            continue
        assert r["copy_mode"] == mode, r
        assert r["first"].startswith(f"rank={rank} peer=") and r["first"].endswith(" mech=query"), r
        assert r["again"] == r["first"], r
        assert 1.5 < r["dt"] < 10.0, r
    assert any(r["first"] == f"rank={k} peer=1 mech=query" for k, r in enumerate(res) if k != 1), res


def test_gpu_bad_inputs_and_auto(gpool):
    for r in gpool.run(fns.gpu_bad_inputs):
        assert r["good_after"], r
        assert all(m.startswith(("ValueError", "TypeError")) for m in r["errors"].values()), r
        assert r["meta"][:3] == ("direct", "vmm", "cuda"), r["meta"]
