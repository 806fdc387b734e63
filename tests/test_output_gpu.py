"""Output/LSE exchange on two (or more) GPUs: the CPU suite on vmm and symm memory with the CUDA kernel and
its Triton twin, the NCCL baselines, CUDA-graph replays with changing inputs, a missing peer.

Run on the 2-GPU machine:  ``python -m pytest -q tests/test_output_gpu.py``  (skipped without 2 GPUs).
"""

from __future__ import annotations

import conftest
import pytest
import torch
from conftest import GPU_BACKEND, GPU_WORLD
from on_ranks import output as fns

pytestmark = pytest.mark.multigpu

KIMI = dict(heads_per_rank=16, head_dim=512)
TS = [1, 2, 7, 16, 24, 32, 64, 128, 256]  # default: LL (<= 8), sentinel (every CTA both to 16, split roles above)


def _pool(pools):
    return pools(GPU_WORLD, GPU_BACKEND)


# kernel variants: "cuda" (the default: LL protocol up to T = 8, then the sentinel kernel - every CTA publishing and
# combining to T = 16, 36-44 publisher CTAs (1 / 2 loads in flight) and the others combining above; PDL), "cuda_ll"
# (always LL), "cuda_plain"
# (the plain kernel at every T: no LL, no sentinel), "cuda_nopdl" (LL and the plain kernel, no PDL),
# "cuda_ll128_32" (the default with an LL128 band (20, 32]), "cuda_ll128" (LL up to the threshold, then LL128:
# policy cuda_opts ("ll128",)), "cuda_ll128_only" (LL128 at every T), "cuda_chunked" / "cuda_chunked_only" (the same
# with cuda_opts ("chunked",)), "cuda_chunked_split" (("chunked", "split_roles")), "cuda_sentinel" (the sentinel
# kernel above LL with every CTA both at every T), "cuda_sentinel_only" (the same at every T, no LL),
# "cuda_sentinel_split" (split roles at every T, 36 publishers with 2 loads in flight, no LL), "triton" (the Triton
# twin)
VARIANTS = {
    "cuda": ("cuda", None),
    "cuda_ll": ("cuda", "max"),
    "cuda_plain": ("cuda", 0),
    "cuda_ll128": ("cuda", None),
    "cuda_ll128_only": ("cuda", 0),  # every T on LL128 (no LL)
    "cuda_chunked": ("cuda", None),
    "cuda_chunked_only": ("cuda", 0),  # every T on the chunked kernel (no LL)
    "cuda_chunked_split": ("cuda", None),
    "cuda_nopdl": ("cuda", None),  # the kernel without PDL
    "cuda_ll128_32": ("cuda", None),  # LL128 band (20, 32] instead of the default (20, 48]
    "cuda_sentinel": ("cuda", None),
    "cuda_sentinel_only": ("cuda", 0),
    "cuda_sentinel_split": ("cuda", 0),
    "triton": ("triton", None),
}
OPTS = {
    "cuda_ll128": ("ll128",),
    "cuda_ll128_only": ("ll128",),
    "cuda_chunked": ("chunked",),
    "cuda_chunked_only": ("chunked",),
    "cuda_chunked_split": ("chunked", "split_roles"),
    "cuda_nopdl": (),
    "cuda_plain": ("pdl",),
    "cuda_sentinel": {"cuda_opts": ("pdl", "sentinel"), "cuda_sentinel_split": ()},
    "cuda_sentinel_only": {
        "cuda_opts": ("pdl", "sentinel"),
        "cuda_sentinel_min_tokens": 0,
        "cuda_sentinel_split": (),
    },
    "cuda_sentinel_split": {
        "cuda_opts": ("pdl", "sentinel"),
        "cuda_sentinel_min_tokens": 0,
        "cuda_sentinel_split": ((0, 36, 2),),
    },
}  # policy.cuda_opts of a variant (absent: the library default, ("pdl", "sentinel")), or policy fields (a dict)
# ll128_max_tokens of a variant (absent: the default, 0 = off)
LL128 = {"cuda_plain": 0, "cuda_ll128_32": 32, "cuda_sentinel_only": 0, "cuda_sentinel_split": 0}


def _run(pool, kernel: str, fn_name: str, cfg: dict, *args, **kw):
    """``fns.<fn_name>(cfg, *args)`` on every rank, ``cfg`` with the variant's policy (``OPTS``)."""
    return pool.run(getattr(fns, fn_name), dict(cfg, policy=fns.policy_with(OPTS.get(kernel))), *args, **kw)


def _cfg(backend, memory="auto", kernel="auto", dtype=torch.bfloat16, lse_base="e", max_tokens=256, **geo):
    g = dict(KIMI, **geo)
    cfg = dict(max_tokens=max_tokens, dtype=dtype, backend=backend, lse_base=lse_base, timeout_s=30.0, **g)
    if backend == "direct":
        kern, ll = VARIANTS.get(kernel, (kernel, None))
        cfg.update(memory=memory, kernel=kern)
        if ll is not None:
            cfg["ll_max_tokens"] = max_tokens if ll == "max" else ll
        if kernel in LL128:
            cfg["ll128_max_tokens"] = LL128[kernel]
    else:
        cfg["device"] = "cuda"
    return cfg


def _ok(res):
    for rank, rows in enumerate(res):
        for r in rows:
            assert r["ok"], f"rank {rank}: {r}"


@pytest.mark.parametrize("memory", ["vmm", "symm"])
@pytest.mark.parametrize(
    "kernel",
    [
        "cuda",
        "cuda_ll",
        "cuda_plain",
        "cuda_nopdl",
        "cuda_ll128",
        "cuda_ll128_32",
        "cuda_chunked",
        "cuda_sentinel",
        "cuda_sentinel_only",
        "cuda_sentinel_split",
        "triton",
    ],
)
def test_direct_agrees_with_reference(pools, memory, kernel):
    """Kimi geometry, T up to 256, adversarial LSEs, return_lse; bf16 base e and fp16 base 2 (T up to 64);
    50 calls back to back with new inputs and no barrier."""
    cases = [dict(T=t, return_lse=bool(i % 2)) for i, t in enumerate(TS)]
    pool = _pool(pools)
    res = _run(pool, kernel, "run_cases", _cfg("direct", memory, kernel), cases, 41)
    _ok(res)
    assert res[0][0]["backend"] == "direct" and res[0][0]["memory"] == memory
    assert res[0][0]["kernel"] == VARIANTS[kernel][0]
    res = _run(pool, kernel, "run_cases", _cfg("direct", memory, kernel, torch.float16, 2), cases[:4], 42)
    _ok(res)
    many = [dict(T=(i * 37) % 64 + 1, return_lse=(i % 4 == 0)) for i in range(50)]
    _ok(_run(pool, kernel, "run_cases", _cfg("direct", memory, kernel), many, 43))


def test_odd_geometry_falls_back_to_triton(pools):
    """head_dim not a multiple of 8: kernel='auto' picks the Triton twin, which still matches."""
    res = _pool(pools).run(fns.run_cases, _cfg("direct", "vmm", heads_per_rank=3, head_dim=20), [dict(T=5)], 44)
    _ok(res)
    assert res[0][0]["kernel"] == "triton"


@pytest.mark.parametrize("backend", ["a2a", "ag_rs"])
def test_nccl_baselines_agree(pools, backend):
    cases = [dict(T=t, return_lse=bool(i % 2)) for i, t in enumerate(TS)]
    _ok(_pool(pools).run(fns.run_cases, _cfg(backend), cases, 51))


def test_auto_prefers_vmm(pools):
    res = _pool(pools).run(fns.run_cases, _cfg("auto"), [dict(T=3)], 52)
    _ok(res)
    assert res[0][0]["backend"] == "direct" and res[0][0]["memory"] in ("vmm", "symm"), res[0][0]


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_cuda_kernel_and_triton_twin_match(pools, memory):
    res = _pool(pools).run(fns.cuda_triton_twins, memory, [1, 3, 64, 256], 61)
    for rows in res:
        assert rows[-1]["kernels"] == ("cuda", "triton"), rows[-1]
        for r in rows[:-1]:
            assert r["cuda_ok"] and r["triton_ok"], r
            assert r["differ"] <= r["numel"] // 1000, r  # same math; only exp/log approximations may differ


@pytest.mark.parametrize("memory", ["vmm", "symm"])
@pytest.mark.parametrize(
    "kernel",
    [
        "cuda",
        "cuda_plain",
        "cuda_nopdl",
        "cuda_ll128",
        "cuda_ll128_32",
        "cuda_chunked",
        "cuda_chunked_split",
        "cuda_sentinel",
        "cuda_sentinel_only",
        "cuda_sentinel_split",
        "triton",
    ],
)
def test_10000_graph_replays_with_changing_inputs(pools, memory, kernel):
    """One graph = a T=128 call (plain / LL128 / chunked protocol), a T=24 call (the default's LL128 range) and a
    T=3 call (LL protocol for "cuda*")."""
    replays = conftest.replays(10_000 if kernel not in ("cuda_plain", "triton") else 2_000)
    cfg = _cfg("direct", memory, kernel)
    res = _run(_pool(pools), kernel, "graph_replays", cfg, replays, 128, 3, 5, 24, timeout=900)
    for r in res:
        assert r["kernel"] == VARIANTS[kernel][0] and r["memory"] == memory, r
        assert r["replays"] == replays and r["mismatches"] == 0, r


@pytest.mark.graph_collective
def test_graph_replays_baselines(pools):
    for backend in ("a2a", "ag_rs"):
        res = _pool(pools).run(fns.graph_replays, _cfg(backend), 200, 64, 2)
        assert all(r["mismatches"] == 0 for r in res), res


@pytest.mark.parametrize(
    "kernel",
    ["cuda", "cuda_plain", "cuda_nopdl", "cuda_ll128_only", "cuda_chunked_only", "cuda_sentinel_only", "triton"],
)
def test_missing_peer_raises_timeout_on_gpu(pools, kernel):
    cfg = _cfg("direct", "vmm", kernel, max_tokens=8)
    cfg.pop("timeout_s")
    res = _run(_pool(pools), kernel, "missing_peer", cfg, 1, 2.0)
    assert res[1] == {"absent": True}
    for r, d in enumerate(res):  # every present rank times out (at W > 2 possibly on a late present peer)
        if r == 1:
            continue
        assert d["first"].startswith(f"rank={r} peer=") and d["first"].endswith(" mech=output"), res
        assert d["second"] == d["first"] and d["check"] == "PeerTimeoutError", res
        assert d["dt"] < 15.0, res
    assert any(d["first"] == f"rank={r} peer=1 mech=output" for r, d in enumerate(res) if r != 1), res


@pytest.mark.parametrize("memory", ["vmm", "symm"])
def test_create_close_cycles(pools, memory):
    res = _pool(pools).run(fns.create_close_cycles, _cfg("direct", memory, max_tokens=16), 5)
    for r in res:
        assert r["after"]["fds"] <= r["before"]["fds"], r
