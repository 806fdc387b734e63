"""vLLM 0.34.0's peers (bench/peers) against peerdcp's references, under the Triton interpreter.

a2a Output pack + combine:

The all-to-all itself is a permutation (rank r receives every source's slot r), done here by indexing, so the
peer's two kernels are checked for every rank of W simulated ranks in one process. A peer API change shows up
here on CPU. Skipped with the reason when scripts/setup_peers.sh has not extracted the files.

Under the interpreter vLLM's combine lands outside peerdcp's fp32 error-model bound (``dcp_reduce_bounds``) by
up to 2 bf16 ulps: the interpreter's bf16 cast truncates instead of rounding to nearest-even. On an H100 the same
kernels lie inside the bound (0 of 16384 outputs outside at W = 2 and 4: ``python -m bench.peers.gpu_check``,
bench/RESULTS.md "Peers"); ``test_vllm_a2a_fp32_bound`` checks the bound where the casts are the GPU's, and
``test_vllm_a2a_layout`` checks the exchange layout and weights on CPU, whose faults give O(1) errors, at 3 bf16
ulps of the largest output.

ag_rs: vLLM's CorrectAttnCPOutKernel on every simulated rank, then the reduce-scatter's bf16 sum, against
``combine`` (layout and weights, at W + 1 bf16 ulps of the largest output).

fused_q (bench/peers/fused_q.py): the interpreter's own bf16 / e4m3 casts are not the GPU's round-to-nearest-even
(bf16 truncates; e4m3 errs by up to 8 steps), so on CPU the BF16 output is checked as layout + math: the nope
part byte-equal to ``widened_query``, the rotated part within one bf16 step of the fp32 contract's value; the
FP8 output, and byte equality / the fp32 bound, only on a GPU (``python -m bench.peers.gpu_check``).

Top-K (bench/peers/topk.py): vLLM's Triton pack and symmetric-memory push for simulated ranks: every packed
pair, the inbox layout, and canonical_topk over the candidates equal to canonical_topk over the full logits.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from peerdcp.output import reference as ref


@pytest.fixture(scope="module")
def vllm_dcp():
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_peers_under_interpreter starts that process)")
    from bench import peers

    mod, why = peers.load_vllm_dcp()
    if mod is None:
        pytest.skip(why)
    return mod


def _runs_here() -> str:
    if torch.cuda.is_available():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("runs under TRITON_INTERPRET=1 (test_peers_under_interpreter starts that process)")
    return "cpu"


@pytest.fixture(scope="module")
def vllm_fused_q():
    _runs_here()
    from bench.peers import fused_q

    mod, why = fused_q.load()
    if mod is None:
        pytest.skip(why)
    return mod


@pytest.mark.parametrize("W,T,H", [(2, 3, 4), (4, 2, 2)])
def test_vllm_fused_q_bf16(vllm_fused_q, W: int, T: int, H: int) -> None:
    from bench.peers import fused_q
    from peerdcp.query import reference as ref
    from peerdcp.query.rope import cos_sin_cache

    dev = _runs_here()
    cs = cos_sin_cache("deepseek-v3.2", device=dev)
    g = torch.Generator().manual_seed(100 * W + T)
    nopes = [torch.randn(T, H, 512, generator=g).to(torch.bfloat16).to(dev) for _ in range(W)]
    pes = [torch.randn(T, H, 64, generator=g).to(torch.bfloat16).to(dev) for _ in range(W)]
    pos = torch.randint(0, cs.shape[0], (T,), generator=g).to(dev)
    pos[0] = 0  # position 0: cos 1, sin 0, the rotation is exact
    got = torch.cat([fused_q.rank_rows(vllm_fused_q, nopes[r], pes[r], pos, cs, torch.bfloat16) for r in range(W)], 1)
    want = ref.widened_query(nopes, pes, pos, cs, out_dtype=torch.bfloat16)
    assert got.shape == want.shape == (T, W * H, 576)
    assert torch.equal(got[..., :512].view(torch.int16), want[..., :512].view(torch.int16)), "nope part moved"
    rows = cs[pos.long()].unsqueeze(1)
    exact = torch.cat([ref.apply_rope(p, rows, "interleaved") for p in pes], dim=1).double()  # fp32 contract
    ulp = 2.0 ** (torch.floor(torch.log2(exact.abs().clamp_min(2.0**-126))) - 7)
    err = (got[..., 512:].double() - exact).abs()
    assert bool((err < ulp).all()), f"rotated part off by {float((err / ulp).max()):.2f} bf16 steps"
    if dev == "cuda":
        res, detail = fused_q.verdict(got, nopes, pes, pos, cs, torch.bfloat16)
        assert res != "different", detail


def test_vllm_fused_q_fp8(vllm_fused_q) -> None:
    from bench.peers import fused_q

    if _runs_here() != "cuda":
        pytest.skip("the interpreter's e4m3 cast is not the GPU's saturating RNE: checked on a GPU only")
    ok, detail = fused_q.check("cuda", out_dtype=torch.float8_e4m3fn)
    assert ok, detail


@pytest.mark.parametrize("W,I", [(2, 1), (4, 64)])
def test_vllm_topk_pack_and_push(W: int, I: int) -> None:
    from bench.peers import topk

    dev = _runs_here()
    res = topk.check(dev, world=W, rows=3, L=1200, k=256, interleave=I)
    assert [r[0] for r in res] == ["vllm-topk-pack", "vllm-topk-push"]
    for name, ok, detail in res:
        if ok is None:
            pytest.skip(detail)
        assert ok, f"{name}: {detail}"


@pytest.mark.parametrize("W,T,H,D", [(2, 3, 4, 16), (4, 2, 8, 32)])
def test_vllm_a2a_layout(vllm_dcp, W: int, T: int, H: int, D: int) -> None:
    from bench import peers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1000 * W + T)
    outs = [torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(W)]
    lses = [(3 * torch.randn(T, H, generator=g)).to(dev) for _ in range(W)]
    lses[0][0, 0] = float("-inf")  # an empty source for one row: zero weight
    sends = [peers.vllm_a2a_pack(vllm_dcp, outs[s], lses[s], W) for s in range(W)]
    for r in range(W):
        recv = torch.stack([sends[s][r] for s in range(W)])
        got = torch.full((T, H // W, D), float("nan"), dtype=torch.bfloat16, device=dev)  # poisoned
        got_o, got_l = peers.vllm_a2a_rank(vllm_dcp, recv, D, out=got)
        want_o, want_l = ref.combine(*ref.rank_sources(outs, lses, r), return_lse=True)
        assert not got_o.isnan().any(), f"rank {r}: poisoned output left"
        ulp = 2.0 ** (torch.floor(torch.log2(want_o.abs().max())) - 7)
        err = (got_o.cpu().double() - want_o.cpu()).abs().max()
        assert err <= 3 * ulp, f"rank {r}: max error {float(err)} > 3 bf16 ulps ({float(3 * ulp)})"
        # vLLM carries the LSE in two bf16 slots (hi + lo): its merged LSE is good to about 2^-16 relative.
        torch.testing.assert_close(got_l.cpu().double(), want_l.cpu(), rtol=2**-14, atol=2**-14)


@pytest.mark.parametrize("W", [2, 4])
def test_vllm_ag_rs_correction(vllm_dcp, W: int) -> None:
    """vLLM's ag_rs: CorrectAttnCPOutKernel on every simulated rank, then the reduce-scatter's bf16 sum. Each rank's
    corrected output and the sum round to bf16 once each: within W + 1 bf16 ulps of the largest output; the LSE,
    computed in fp32 from fp32 inputs, to fp32 accuracy."""
    from bench import peers

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    T, H, D = 3, 2 * W, 32
    g = torch.Generator().manual_seed(3000 + W)
    outs = [torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(dev) for _ in range(W)]
    lses = [(3 * torch.randn(T, H, generator=g)).to(dev) for _ in range(W)]
    lses[1][0, 0] = float("-inf")  # an empty source for one row: zero weight
    gathered = torch.stack(lses)
    res = [peers.vllm_ag_rs_correct(vllm_dcp, outs[r], gathered, r) for r in range(W)]
    total = res[0][0]
    for c, _ in res[1:]:
        total = (total.float() + c.float()).to(torch.bfloat16)
    h = H // W
    for r in range(W):
        want_o, want_l = ref.combine(*ref.rank_sources(outs, lses, r), return_lse=True)
        got = total[:, r * h : (r + 1) * h].cpu().double()
        ulp = 2.0 ** (torch.floor(torch.log2(want_o.abs().max())) - 7)
        err = (got - want_o.cpu()).abs().max()
        assert err <= (W + 1) * ulp, f"rank {r}: max error {float(err)} > {W + 1} bf16 ulps"
        for s in range(W):  # every rank computes the same merged LSE
            got_l = res[s][1][:, r * h : (r + 1) * h].cpu().double()
            torch.testing.assert_close(got_l, want_l.cpu(), rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_vllm_a2a_fp32_bound(vllm_dcp) -> None:
    from bench import peers

    if not torch.cuda.is_available():
        pytest.skip("the interpreter's bf16 cast truncates: the bound is checked with the GPU's casts")
    W, T, H, D = 2, 3, 4, 16
    g = torch.Generator().manual_seed(2003)
    outs = [torch.randn(T, H, D, generator=g).to(torch.bfloat16) for _ in range(W)]
    lses = [3 * torch.randn(T, H, generator=g) for _ in range(W)]
    sends = [peers.vllm_a2a_pack(vllm_dcp, outs[s].cuda(), lses[s].cuda(), W) for s in range(W)]
    got_o, _ = peers.vllm_a2a_rank(vllm_dcp, torch.stack([sends[s][0] for s in range(W)]), D)
    o_lo, o_hi, _, _ = ref.dcp_reduce_bounds(outs, lses, 0)
    assert int(ref.outside_bounds(got_o.cpu(), o_lo, o_hi).sum()) == 0


def test_vllm_pack_rejects_bad_heads(vllm_dcp) -> None:
    from bench import peers

    with pytest.raises(ValueError, match="world_size"):
        peers.vllm_a2a_pack(vllm_dcp, torch.zeros(1, 3, 8, dtype=torch.bfloat16), torch.zeros(1, 3), 2)


@pytest.mark.skipif(
    torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1", reason="the tests above run in this process"
)
def test_peers_under_interpreter() -> None:
    """On CPU, this file again in a child process under TRITON_INTERPRET=1 (the mode is fixed per process)."""
    from bench import peers

    _, why = peers.load_vllm_dcp()
    if not (peers.ROOT / "vllm").is_dir():
        pytest.skip(why)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    # 9 = a2a: the layout cases, the argument check; ag_rs (two cases); fused_q BF16 (two cases); the Top-K pack
    # and push (two cases). Skipped in the child: fused_q FP8 and the a2a fp32 bound (GPU casts only), this test
    assert r.returncode == 0 and "9 passed, 3 skipped" in r.stdout, r.stdout[-3000:] + r.stderr[-2000:]
