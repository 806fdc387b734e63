"""The CUDA kernel's opt-in variants (``OutputPolicy.cuda_opts``) and its benchmark-only stage breakdown:
the parts that can be checked without a GPU (knob validation, the ctypes mirror of the parameter block,
the C entry point's rejection of bad masks), and GPU tests (marked, skipped here) that each variant agrees
with the reference and that a breakdown run leaves the protocol state consistent.

GPU:  ``python -m pytest -q tests/test_output_variants.py``  on the 2-GPU machine.
"""

from __future__ import annotations

import ctypes
import dataclasses
import types

import pytest
import torch
from conftest import GPU_BACKEND
from on_ranks import output as fns

from peerdcp.output import ops
from peerdcp.output import policy as P
from peerdcp.output import reducer as R

HOST = dict(max_tokens=4, heads_per_rank=3, head_dim=16, backend="direct", memory="host", device="cpu", timeout_s=30.0)


def test_opts_names_and_masks():
    assert P.DEFAULT_POLICY.cuda_opts == ("pdl", "sentinel")  # the default
    assert set(P.CUDA_OPTS) == set(ops.OPTS)
    assert ops.opts_mask(()) == 0
    assert ops.opts_mask(("tight_grid", "pdl")) == 5
    with pytest.raises(ValueError, match="unknown CUDA kernel option 'fast'"):
        ops.opts_mask(("fast",))
    bits = list(ops.STAGES.values())
    assert len(set(bits)) == len(bits) and all(b & (b - 1) == 0 for b in bits)  # distinct single bits
    assert sum(bits) == ops._STAGES_ALL


def test_policy_default_is_frozen_and_reads_the_environment_when_made(monkeypatch):
    monkeypatch.delenv("PEERDCP_OUTPUT_KERNEL", raising=False)
    assert P.default_policy() is P.DEFAULT_POLICY and P.DEFAULT_POLICY.direct_kernel == "cuda"
    monkeypatch.setenv("PEERDCP_OUTPUT_KERNEL", "triton")
    assert P.default_policy().direct_kernel == "triton" and P.DEFAULT_POLICY.direct_kernel == "cuda"
    with pytest.raises(dataclasses.FrozenInstanceError):
        P.DEFAULT_POLICY.cuda_opts = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        P.TUNING["cuda_opts"] = ()  # type: ignore[index]  # the former names: read-only views of the default
    assert P.TUNING["cuda_sentinel_split"] == P.DEFAULT_POLICY.cuda_sentinel_split and R.TUNING is P.TUNING


def test_policy_must_be_an_output_policy(pools):
    res = pools(2).run(fns.construct, dict(HOST, policy={"cuda_opts": ()}))
    assert all(r.get("error", "").startswith("TypeError: OutputReducer: policy must be") for r in res), res


def test_breakdown_needs_a_cuda_reducer():
    for obj in (types.SimpleNamespace(kernel="triton"), types.SimpleNamespace(kernel="cuda"), object()):
        with pytest.raises(ValueError, match="kernel='cuda'"):
            ops._set_breakdown_stages(obj, ops.STAGE_SKIP_SYNC)


def test_cuda_opts_validated_on_every_rank_and_ignored_by_triton(pools):
    for bad in [("fast",), "pdl", 3]:
        res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(bad)))
        assert all(r.get("error", "").startswith("ValueError") and "cuda_opts" in r["error"] for r in res), res
    res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(("tight_grid", "pdl"))))
    assert all(r.get("kernel") == "triton" and r["cuda_opts"] == () for r in res), res
    for pair in [("ll128", "tight_grid"), ("chunked", "ll128"), ("chunked", "early_load")]:
        res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(pair)))
        assert all(r.get("error", "").startswith("ValueError") and "exclude each other" in r["error"] for r in res)
    res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(("split_roles",))))
    assert all(r.get("error", "").startswith("ValueError") and "'chunked' only" in r["error"] for r in res), res


def test_ll128_band():
    band = P.ll128_band
    d = P.DEFAULT_POLICY
    assert (d.cuda_ll128_min_tokens, d.cuda_ll128_max_tokens) == (20, 0)  # the default: off
    assert band(None, ("pdl",), 256, 8, 16, 512) == (0, 0)
    on = dataclasses.replace(d, cuda_ll128_max_tokens=48)  # the band logic, with LL128's best band (20, 48]

    def b(*args):
        return band(*args, policy=on)

    assert b(None, ("pdl",), 256, 8, 16, 512) == (48, 20)
    assert b(None, ("pdl",), 32, 8, 16, 512) == (32, 20)  # capped at max_tokens
    assert b(None, ("pdl",), 16, 8, 16, 512) == (0, 0)  # max_tokens inside the LL128 floor: never used
    assert b(0, ("pdl",), 256, 8, 16, 512) == (0, 0)  # off
    assert b(64, (), 256, 64, 16, 512) == (0, 0)  # at or below the LL range
    assert b(None, ("ll128",), 256, 8, 16, 512) == (256, 0)  # every T above the LL range
    assert b(None, ("ll128", "pdl"), 256, 256, 16, 512) == (0, 0)  # LL at every T
    assert b(None, ("tight_grid",), 256, 8, 16, 512) == (0, 0)
    assert b(None, ("chunked",), 256, 8, 16, 512) == (0, 0)
    assert b("48", (), 256, 8, 16, 512) == (0, 0) and b(None, (), 256, 8, "16", 512) == (0, 0)
    assert R.ll128_band is band  # still importable from its former module


def test_ll128_max_tokens_validated_on_every_rank(pools):
    for bad, exc in ((-1, "ValueError"), ("8", "TypeError"), (True, "TypeError")):
        res = pools(2).run(fns.construct, dict(HOST, ll128_max_tokens=bad, policy=fns.policy_with(("pdl",))))
        assert all(r.get("error", "").startswith(exc) and "ll128_max_tokens" in r["error"] for r in res), res
    res = pools(2).run(fns.construct, dict(HOST, ll128_max_tokens=4, policy=fns.policy_with(("pdl",))))
    assert all(r.get("kernel") == "triton" for r in res), res  # the Triton path has no LL128: ignored


@pytest.mark.nvcc
def test_params_mirror_and_bad_masks_rejected_before_any_cuda_call():
    """Builds the .so with nvcc (no GPU needed): the ctypes mirror has the C size (library() checks it), and
    the entry point rejects unknown stage / opt bits and a breakdown combined with early_load / pdl with
    cudaErrorInvalidValue (1) before it touches CUDA."""
    lib = ops.library()
    assert lib.peerdcp_output_direct_params_size() == ctypes.sizeof(ops.OutputDirectParams)
    epochs = torch.zeros(4, dtype=torch.int64)
    launcher = ops.DirectLauncher(
        peer_addrs=[0x1000, 0x2000], epochs=epochs, err_addr=0, rank=0, heads=16, head_dim=512, max_tokens=8,
        programs=4, heads_per_unit=4, lse_off=256, payload_off=512, timeout_ns=10**9, base2=False,
        dtype=torch.bfloat16, mech=1, device=0, opts=ops.OPTS["early_load"],
    )  # fmt: skip
    p = launcher._p
    assert p.stages == 0 and p.opts == 2
    with pytest.raises(ValueError, match="not with opts"):
        launcher._set_stages(ops.STAGE_SKIP_SYNC)
    for bad in (64, -1, True, 1.0):
        with pytest.raises(ValueError, match="stages"):
            launcher._set_stages(bad)
    p.T = 1

    def rc(stages: int, opts: int) -> int:
        p.stages, p.opts = stages, opts
        return lib.peerdcp_output_direct(ctypes.byref(p), None, 0)

    invalid = 1  # cudaErrorInvalidValue
    assert rc(64, 0) == invalid
    assert rc(0, ops.OPTS["ll128"] | ops.OPTS["tight_grid"]) == invalid
    assert rc(ops.STAGE_SKIP_SYNC, ops.OPTS["ll128"]) == invalid
    assert rc(ops.STAGE_SKIP_SYNC, ops.OPTS["chunked"]) == invalid
    assert rc(0, ops.OPTS["chunked"] | ops.OPTS["ll128"]) == invalid
    assert rc(0, ops.OPTS["chunked"] | ops.OPTS["early_load"]) == invalid
    assert rc(0, ops.OPTS["split_roles"]) == invalid  # split_roles needs chunked
    assert rc(0, 128) == invalid  # an unknown bit
    p.sn_pub, p.sn_loads = -1, 2
    assert rc(0, ops.OPTS["sentinel"]) == invalid
    p.sn_pub = 0
    for loads in (0, 3):  # 1 or 2 loads in flight per publishing thread
        p.sn_loads = loads
        assert rc(0, ops.OPTS["sentinel"]) == invalid
    p.sn_loads = 2
    assert rc(0, ops.OPTS["sentinel"] | ops.OPTS["tight_grid"]) == invalid
    assert rc(0, ops.OPTS["sentinel"] | ops.OPTS["chunked"]) == invalid
    assert rc(ops.STAGE_SKIP_SYNC, ops.OPTS["sentinel"]) == invalid
    p.T, p.H = 8, 2**26  # T * H * D / 8 vectors would overflow int32
    assert rc(0, ops.OPTS["sentinel"]) == invalid
    p.T, p.H, p.sn_pub = 1, 16, 0
    assert rc(0, ops.OPTS["ll128"]) == invalid  # ll128_max_tokens 0: no LL128 region
    p.max_tokens = p.ll128_max_tokens = 2**20 - 1  # LL128 line indices would overflow int32
    assert rc(0, ops.OPTS["ll128"]) == invalid
    p.max_tokens, p.ll128_max_tokens = 8, 9  # more LL128 rows than max_tokens
    assert rc(0, ops.OPTS["ll128"]) == invalid
    p.max_tokens, p.ll128_max_tokens = 8, 0
    assert rc(ops.STAGE_SKIP_SYNC, ops.OPTS["pdl"]) == invalid
    assert rc(ops.STAGE_SKIP_SYNC, ops.OPTS["early_load"]) == invalid
    p.stages, p.opts = 0, 2


@pytest.mark.nvcc
def test_ll128_bit_chosen_per_call_from_T():
    """The launcher sets the LL128 bit for T above ll128_min_tokens only (the C side then takes LL128 for
    T <= ll128_max_tokens). Checked on the parameter block the call fills (``_fill``), without a launch: the peer
    addresses are fake (a launch would fault the GPU and every later test in the process)."""
    pdl, ll128 = ops.OPTS["pdl"], ops.OPTS["ll128"]
    launcher = ops.DirectLauncher(
        peer_addrs=[0x1000, 0x2000], epochs=torch.zeros(4, dtype=torch.int64), err_addr=0, rank=0, heads=16,
        head_dim=512, max_tokens=64, programs=4, heads_per_unit=4, lse_off=256, payload_off=512, timeout_ns=10**9,
        base2=False, dtype=torch.bfloat16, mech=1, device=0, ll_max_tokens=8, opts=pdl | ll128, ll128_off=1024,
        ll128_max_tokens=48, ll128_min_tokens=20,
    )  # fmt: skip
    for T, want in ((1, pdl), (20, pdl), (21, pdl | ll128), (48, pdl | ll128), (64, pdl | ll128)):
        x = torch.zeros(T, 32, 512, dtype=torch.bfloat16)
        launcher._fill(x, torch.zeros(T, 32), torch.zeros(T, 16, 512, dtype=torch.bfloat16), None)
        assert (launcher._p.T, launcher._p.opts) == (T, want)


@pytest.mark.nvcc
def test_sentinel_bit_chosen_per_call_from_T():
    """The launcher sets the sentinel bit for T above sn_min_tokens only, beside the LL128 band's bit."""
    pdl, ll128, sn = ops.OPTS["pdl"], ops.OPTS["ll128"], ops.OPTS["sentinel"]
    launcher = ops.DirectLauncher(
        peer_addrs=[0x1000, 0x2000], epochs=torch.zeros(4, dtype=torch.int64), err_addr=0, rank=0, heads=16,
        head_dim=512, max_tokens=64, programs=4, heads_per_unit=4, lse_off=256, payload_off=512, timeout_ns=10**9,
        base2=False, dtype=torch.bfloat16, mech=1, device=0, ll_max_tokens=8, opts=pdl | ll128 | sn, ll128_off=1024,
        ll128_max_tokens=48, ll128_min_tokens=20, sn_off=4096, sn_lse_off=8192, sn_min_tokens=48,
        sn_split=((56, 32, 1), (60, 40, 2)),
    )  # fmt: skip
    assert (launcher._p.sn_off, launcher._p.sn_lse_off) == (4096, 8192)
    cases = (
        (1, pdl, 0, 2),
        (21, pdl | ll128, 0, 2),
        (48, pdl | ll128, 0, 2),
        (49, pdl | ll128 | sn, 0, 2),
        (57, pdl | ll128 | sn, 32, 1),
        (61, pdl | ll128 | sn, 40, 2),
    )
    for T, want, pub, loads in cases:
        x = torch.zeros(T, 32, 512, dtype=torch.bfloat16)
        launcher._fill(x, torch.zeros(T, 32), torch.zeros(T, 16, 512, dtype=torch.bfloat16), None)  # no launch
        assert (launcher._p.T, launcher._p.opts, launcher._p.sn_pub, launcher._p.sn_loads) == (T, want, pub, loads)


def test_sentinel_split_table_in_bytes():
    """The default table splits the Kimi geometry (16 KiB per token) above T = 16 and switches at T = 160, 224
    and 384; a 32-head geometry (32 KiB per token) at half those T; a publisher count >= the grid means no
    split."""
    table = P.DEFAULT_POLICY.cuda_sentinel_split
    assert table == ((1 << 18, 40, 1), (5 << 19, 36, 2), (7 << 19, 40, 2), (3 << 21, 44, 2))
    kimi = ((16, 40, 1), (160, 36, 2), (224, 40, 2), (384, 44, 2))
    assert P.sentinel_split_tokens(table, 16 * 512 * 2, 264) == kimi
    assert P.sentinel_split_tokens(table, 32 * 512 * 2, 264) == tuple((t // 2, n, u) for t, n, u in kimi)
    assert P.sentinel_split_tokens(((0, 36, 1), (100, 300, 2)), 1000, 264) == ((0, 36, 1), (0, 0, 2))
    for T in range(1, 300):  # T > b // k  <=>  T * k > b
        for b in (0, 1, 999, 1000, 1001, 65536, 1 << 20):
            threshold = P.sentinel_split_tokens(((b, 1, 2),), 1000, 8)[0][0]
            assert (threshold < T) is (b < T * 1000)


def test_sentinel_tuning_validated_on_every_rank(pools):
    bad_values = {
        "cuda_sentinel_min_tokens": (-1, "4", True),
        "cuda_sentinel_split": (
            5,
            ((64,),),
            ((64, 36),),
            ((64, -1, 2),),
            ((64, 36, 2), (32, 40, 2)),
            ((8, True, 2),),
            ((8, 36, 3),),
            ((8, 36, 0),),
        ),
    }
    for key, bads in bad_values.items():
        for bad in bads:
            res = pools(2).run(
                fns.construct, dict(HOST, policy=fns.policy_with({"cuda_opts": ("sentinel",), key: bad}))
            )
            assert all(r.get("error", "").startswith("ValueError") and key in r["error"] for r in res), res
    for pair in [("sentinel", "tight_grid"), ("sentinel", "chunked")]:
        res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(pair)))
        assert all(r.get("error", "").startswith("ValueError") and "exclude each other" in r["error"] for r in res)
    res = pools(2).run(fns.construct, dict(HOST, policy=fns.policy_with(("sentinel", "pdl"))))
    assert all(r.get("kernel") == "triton" and r["cuda_opts"] == () for r in res), res  # CPU: Triton, no variant


# ---------------------------------------------------------------------------------------------- GPU
KIMI = dict(heads_per_rank=16, head_dim=512, max_tokens=256, timeout_s=30.0, backend="direct", kernel="cuda")
OPT_SETS = [
    ("tight_grid",),
    ("early_load",),
    ("pdl",),
    ("tight_grid", "early_load", "pdl"),
    ("ll128",),
    ("ll128", "pdl"),
    ("chunked",),
    ("chunked", "pdl", "tight_grid"),
    ("chunked", "split_roles"),
    ("sentinel", "pdl"),  # the default: every T above LL (split roles above 1 MiB per slice, Kimi T = 64)
    {"cuda_opts": ("sentinel",), "cuda_sentinel_min_tokens": 0},  # every T above the LL range
    {  # the publisher count and loads in flight switch at T = 100 (Kimi: 16 KiB per token)
        "cuda_opts": ("sentinel", "pdl"),
        "cuda_sentinel_min_tokens": 0,
        "cuda_sentinel_split": ((0, 36, 1), (100 << 14, 40, 2)),
    },
    {"cuda_opts": ("sentinel", "pdl"), "cuda_sentinel_min_tokens": 0, "cuda_sentinel_split": ()},
]
OPT_IDS = ["+".join(o) if isinstance(o, tuple) else "+".join(o["cuda_opts"]) + f"-{i}" for i, o in enumerate(OPT_SETS)]


@pytest.mark.multigpu
@pytest.mark.parametrize("opts", OPT_SETS, ids=OPT_IDS)
@pytest.mark.parametrize("ll", [None, 0], ids=["ll_default", "plain"])
def test_gpu_opt_in_variants_agree(pools, opts, ll):
    """Each opt-in variant: T from 1 to 256, then 50 back-to-back calls with changing T (tight_grid runs a
    different set of CTAs per T: the per-CTA epochs must still agree), then CUDA-graph replays."""
    cfg = dict(KIMI, memory="vmm")
    if ll is not None:
        cfg["ll_max_tokens"] = ll
    cases = [dict(T=t, return_lse=bool(i % 2)) for i, t in enumerate([1, 2, 7, 64, 128, 256, 3, 100])]
    many = [dict(T=(i * 37) % 64 + 1, return_lse=(i % 4 == 0)) for i in range(50)]
    pool = pools(2, GPU_BACKEND)
    for cs, seed in ((cases, 61), (many, 62)):
        res = pool.run(fns.run_cases, dict(cfg, policy=fns.policy_with(opts)), cs, seed)
        for rank, rows in enumerate(res):
            assert all(r["ok"] for r in rows), (rank, [r for r in rows if not r["ok"]][:3])
            assert rows[0]["kernel"] == "cuda" and "kernel variants" in rows[0]["reason"], rows[0]
    gcfg = {k: v for k, v in cfg.items()}
    res = pool.run(fns.graph_replays, dict(gcfg, policy=fns.policy_with(opts)), 20, 128, 3)
    assert all(r["mismatches"] == 0 for r in res), res


@pytest.mark.multigpu
@pytest.mark.parametrize("T,ll", [(1, None), (8, None), (1, 0), (128, 0)])
def test_gpu_breakdown_leaves_protocol_consistent(pools, T, ll):
    cfg = dict(KIMI, memory="vmm", ll128_max_tokens=0)  # the breakdown runs the LL and plain kernels only
    if ll is not None:
        cfg["ll_max_tokens"] = ll
    # the breakdown masks exist in the build without PDL only (ops rejects them with pdl / early_load)
    res = pools(2, GPU_BACKEND).run(fns.breakdown_then_full, dict(cfg, policy=fns.policy_with(())), T, 71)
    assert all(r == {"instrumented": True, "full": True, "after": True} for r in res), res
