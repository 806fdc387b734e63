"""Output/LSE exchange on CPU: the reference spec, and direct/host, a2a and ag_rs over gloo at W = 2, 3, 4
against it (the direct kernel runs interpreted on host shared memory across real processes)."""

from __future__ import annotations

import glob
import math

import pytest
import torch
from on_ranks import output as fns

from peerdcp.output.reference import (
    _weights,
    combine,
    combine_bounds,
    dcp_reduce,
    dcp_reduce_bounds,
    outside_bounds,
    sanitize_lse,
)

# ------------------------------------------------------------------------------------- the spec itself


def test_reference_sanitizes_and_never_reads_empty_payloads():
    nan = float("nan")
    inf = float("inf")
    o = torch.tensor([[[1.0, 2.0]], [[nan, nan]], [[3.0, 5.0]]])  # [N=3, rows=1, D=2]
    l = torch.tensor([[0.0], [-inf], [math.log(3.0)]])
    out, lse = combine(o, l, return_lse=True)
    assert torch.allclose(out, torch.tensor([[(1 + 3 * 3) / 4, (2 + 5 * 3) / 4]], dtype=torch.float64))
    assert torch.allclose(lse, torch.tensor([math.log(4.0)], dtype=torch.float64))
    # NaN and +inf LSEs are empty shards too; all empty -> 0 and -inf, even with NaN payloads
    out, lse = combine(torch.full((3, 1, 2), nan), torch.tensor([[nan], [inf], [-inf]]), return_lse=True)
    assert torch.equal(out, torch.zeros(1, 2, dtype=torch.float64)) and lse.item() == -inf
    assert torch.equal(sanitize_lse(torch.tensor([nan, inf, -inf, 1.0])), torch.tensor([-inf, -inf, -inf, 1.0]))


def test_reference_bases_agree_and_gaps_are_exact():
    g = torch.Generator().manual_seed(5)
    o = torch.randn(4, 6, 3, 8, generator=g, dtype=torch.float64)
    le = torch.randn(4, 6, 3, generator=g, dtype=torch.float64) * 3
    out_e, lse_e = combine(o, le, lse_base="e", return_lse=True)
    out_2, lse_2 = combine(o, le / math.log(2.0), lse_base=2, return_lse=True)
    assert torch.allclose(out_e, out_2) and torch.allclose(lse_e / math.log(2.0), lse_2)
    # a source 1000 below the max contributes nothing (and is not read: NaN payload stays out)
    o2 = torch.stack([o[0], torch.full_like(o[1], float("nan"))])
    l2 = torch.stack([le[0], le[0] - 1000.0])
    assert torch.allclose(combine(o2, l2), o[0])


def test_dcp_reduce_picks_own_heads():
    W, T, H, D = 3, 2, 2, 4
    outs = [torch.randn(T, W * H, D) for _ in range(W)]
    lses = [torch.zeros(T, W * H) for _ in range(W)]  # equal weights -> plain mean
    for r in range(W):
        want = torch.stack([o[:, r * H : (r + 1) * H] for o in outs]).double().mean(0)
        assert torch.allclose(dcp_reduce(outs, lses, r), want)
    with pytest.raises(ValueError):
        dcp_reduce(outs, lses[:2], 0)
    with pytest.raises(ValueError):
        combine(torch.zeros(2, 3, 4), torch.zeros(2, 4))


def _fp32_combine(o, l, base, gen=None):
    """An fp32 implementation of the combine, as the kernels compute it (maximum, weights, fp32 sums, one
    division): ``(out fp32, lse fp32)``. With ``gen``, every library call errs by its documented maximum in a
    random direction (``combine_bounds``' model): ``__expf``'s 2 + 1.173|d| ulp on each weight, 2 ulp on the
    division, ``__logf``'s 2^-21.41 absolute plus 3 ulp on the logarithm."""
    f = torch.float32
    m, d, w, _ = _weights(l, base, f)  # d rounded in fp32
    ulp = 2.0**-23

    def signs(t):
        return (torch.randint(0, 2, t.shape, generator=gen) * 2 - 1).double()

    if gen is not None:
        d_e = d.double().abs() * (1.0 if base == "e" else math.log(2.0))
        err = torch.where(w > 0, (2 + torch.floor(1.173 * d_e)) * ulp, 0.0)  # (-inf: d_e = inf)
        w = (w.double() * (1 + signs(w) * err)).to(f)
    s = w.sum(dim=0)
    acc = torch.where((w > 0).unsqueeze(-1), w.unsqueeze(-1) * o.to(f), torch.zeros((), dtype=f)).sum(dim=0)
    out = acc / torch.where(s > 0, s, torch.ones_like(s)).unsqueeze(-1)
    log_s = torch.log(torch.where(s > 0, s, torch.ones_like(s)))
    if base != "e":
        log_s = log_s / math.log(2.0)
    if gen is not None:
        out = (out.double() * (1 + signs(out) * 2 * ulp)).to(f)
        log_s = (log_s.double() + signs(log_s) * (2.0**-21.41 + 3 * ulp * log_s.double().abs())).to(f)
    lse = torch.where(s > 0, m + log_s, torch.full_like(m, float("-inf")))
    return out, lse


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("dtype,base", [(torch.bfloat16, "e"), (torch.float16, "2")])
def test_bounds_hold_for_fp32_implementations_and_are_tight(world, dtype, base):
    """``dcp_reduce_bounds`` contains an exact fp32 implementation and one whose library calls err by their
    documented maxima (the GPU's fast exp / log / division), on the adversarial test inputs; and it is tight:
    one output value for almost every element."""
    gen = torch.Generator().manual_seed(world)
    H = 4
    single = total = 0
    for seed in range(6):
        outs, lses = fns.make_inputs(seed, world, 6, H, 32, dtype)
        for r in range(world):
            lo, hi, lse_lo, lse_hi = dcp_reduce_bounds(outs, lses, r, lse_base=base, out_dtype=dtype)
            o = torch.stack([x[:, r * H : (r + 1) * H] for x in outs])
            l = torch.stack([x[:, r * H : (r + 1) * H] for x in lses])
            for g in (None, gen):
                out, lse = _fp32_combine(o, l, base, g)
                assert not outside_bounds(out.to(dtype), lo, hi).any()
                assert not outside_bounds(lse, lse_lo, lse_hi).any()  # -inf rows: -inf alone
            single += int((lo == hi).sum())
            total += lo.numel()
    assert single >= 0.95 * total, single / total


def _fp32_at_limits(o, l, base):
    """fp32 combine whose library calls err by their documented maxima in the worst direction for each output
    element (every weight toward its payload's side of the result, the division away from the fp64 value):
    ``(out fp32, exact fp64)``."""
    f, ulp = torch.float32, 2.0**-23
    exact = combine(o, l, lse_base=base)
    _, d, w, _ = _weights(l, base, f)
    d_e = d.double().abs() * (1.0 if base == "e" else math.log(2.0))
    err = torch.where(w > 0, (2 + torch.floor(1.173 * d_e)) * ulp, 0.0).unsqueeze(-1)
    w = (w.double().unsqueeze(-1) * (1 + torch.sign(o.double() - exact) * err)).to(f)  # [N, rows, D]
    s = w.sum(dim=0)
    acc = torch.where(w > 0, w * o.to(f), torch.zeros((), dtype=f)).sum(dim=0)
    out = acc / torch.where(s > 0, s, torch.ones_like(s))
    return (out.double() * (1 + torch.sign(out.double() - exact) * 2 * ulp)).to(f), exact


@pytest.mark.parametrize("base", ["e", "2"])
def test_bounds_contain_the_worst_case_at_fp32_and_are_within_5x_of_it(base):
    """At fp32 output (no output rounding to hide behind), an implementation at its documented error limits,
    pushed the worst way per element, stays inside ``combine_bounds``, and reaches more than a fifth of the
    half-width somewhere in every case (0.24-0.54 measured): the model is not loose by more than 5x."""
    for W in (2, 3, 8):
        for seed in range(5):
            outs, lses = fns.make_inputs(seed, W, 6, 4, 32, torch.bfloat16)
            o, l = torch.stack([x[:, :4] for x in outs]), torch.stack([x[:, :4] for x in lses])
            lo, hi, _, _ = combine_bounds(o, l, lse_base=base, out_dtype=torch.float32)
            out, exact = _fp32_at_limits(o, l, base)
            assert not outside_bounds(out, lo, hi).any(), (W, seed)
            half = (hi.double() - lo.double()) / 2
            reached = ((out.double() - exact).abs() / half.clamp_min(1e-300))[half > 0].max()
            assert reached > 0.2, (W, seed, float(reached))


def test_bounds_follow_cancellation_and_catch_one_step():
    """Two sources of opposite payloads and LSEs 1e-6 apart: the result (~5e-7) is the difference of two fp32
    weights near 1, so a correct fp32 result lies several bf16 steps from the fp64 value, and the bound widens
    there. Where the interval is one value, one step off is outside."""
    g = torch.Generator().manual_seed(4)
    a = (torch.rand(1, 64, generator=g) + 0.5).to(torch.bfloat16)
    o = torch.stack([a, -a])  # [N = 2, rows = 1, D = 64]
    l = torch.tensor([[0.0], [1e-6]], dtype=torch.float32)
    lo, hi, lse_lo, lse_hi = combine_bounds(o, l)
    out, lse = _fp32_combine(o, l, "e")
    got = out.to(torch.bfloat16)
    exact = combine(o, l).to(torch.bfloat16)
    steps = (got.view(torch.int16).int() - exact.view(torch.int16).int()).abs()
    assert int(steps.max()) >= 2  # "one rounding of the fp64 value" would reject a correct fp32 result
    assert not outside_bounds(got, lo, hi).any() and not outside_bounds(lse, lse_lo, lse_hi).any()
    outs, lses = fns.make_inputs(9, 2, 4, 3, 16, torch.bfloat16, adversarial=False)
    lo, hi, lse_lo, lse_hi = dcp_reduce_bounds(outs, lses, 0)
    one = lo == hi
    moved = (lo.view(torch.int16) + 1).view(torch.bfloat16)  # one step away from 0
    assert int(one.sum()) > 0.9 * lo.numel() and outside_bounds(moved[one], lo[one], hi[one]).all()
    assert outside_bounds(torch.nextafter(lse_hi, torch.tensor(float("inf"))), lse_lo, lse_hi).all()
    with pytest.raises(ValueError, match="disagree"):
        combine_bounds(torch.zeros(2, 3, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="lse_base"):
        combine_bounds(torch.zeros(2, 3, 4), torch.zeros(2, 3), lse_base=10)
    with pytest.raises(TypeError, match="out_dtype"):
        combine_bounds(torch.zeros(2, 3, 4), torch.zeros(2, 3), out_dtype=torch.int16)


# ------------------------------------------------------------------------------------ across ranks

BACKENDS = ["direct", "a2a", "ag_rs"]
GEOMETRY = {2: (3, 16), 3: (3, 8), 4: (2, 16)}  # W -> (heads per rank, head dim): odd sizes, tiny for CPU


def _config(world: int, backend: str, dtype=torch.bfloat16, lse_base="e", max_tokens=8) -> dict:
    H, D = GEOMETRY[world]
    return dict(
        max_tokens=max_tokens, heads_per_rank=H, head_dim=D, dtype=dtype, backend=backend, memory="host",
        device="cpu", lse_base=lse_base, timeout_s=60.0,
    )  # fmt: skip


def _assert_all_ok(res: list[list[dict]]) -> None:
    for rank, rows in enumerate(res):
        for r in rows:
            assert r["ok"], f"rank {rank}: {r}"


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backends_agree_with_reference(pools, world, backend):
    """bf16 base e and fp16 base 2, T from 1 to max_tokens, return_lse on and off, adversarial LSEs
    (-inf / NaN / +inf entries with NaN payloads, all-empty rows, gaps of 300)."""
    cases = [dict(T=t, return_lse=bool(i % 2)) for i, t in enumerate([1, 8, 5, 2, 7])]
    res = pools(world).run(fns.run_cases, _config(world, backend), cases, 11)
    _assert_all_ok(res)
    assert all(r["backend"] == backend for r in res[0])
    res = pools(world).run(fns.run_cases, _config(world, backend, torch.float16, 2), cases[:3], 12)
    _assert_all_ok(res)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_direct_50_back_to_back_calls(pools, world):
    """50 calls with new inputs (and changing T) every call, no barrier: the parity slots must hold."""
    cases = [dict(T=(i * 5) % 8 + 1, return_lse=(i % 3 == 0)) for i in range(50)]
    res = pools(world).run(fns.run_cases, _config(world, "direct", lse_base=2), cases, 21)
    _assert_all_ok(res)
    assert len(res[0]) == 51 and res[0][0]["kernel"] == "triton" and res[0][0]["memory"] == "host"


def test_auto_picks_direct_host_on_cpu(pools):
    res = pools(2).run(fns.run_cases, _config(2, "auto"), [dict(T=3)], 31)
    _assert_all_ok(res)
    assert res[0][0]["backend"] == "direct" and res[0][0]["memory"] == "host"
    assert "host" in res[0][0]["reason"]


@pytest.mark.parametrize("backend", ["direct", "a2a"])
def test_bad_inputs_raise_before_launch(pools, backend):
    cfg = _config(2, backend)
    res = pools(2).run(fns.bad_inputs, cfg)
    for msgs in res:
        d = dict(m.split(": ", 1) for m in msgs)
        assert d["list"].startswith("TypeError") and "partial_out" in d["list"]
        assert d["float32 out"].startswith("TypeError") and "torch.bfloat16" in d["float32 out"]
        assert d["fp16 lse"].startswith("TypeError") and "partial_lse" in d["fp16 lse"]
        assert d["lse as int"].startswith("TypeError")
        for k in ("rank-2 out", "wrong heads", "wrong D"):
            assert d[k].startswith("ValueError") and "W*H=6" in d[k], d[k]
        assert d["lse shape"].startswith("ValueError") and "partial_lse" in d["lse shape"]
        assert d["too many tokens"].startswith("ValueError") and "max_tokens=8" in d["too many tokens"]
        assert d["non-contiguous out"].startswith("ValueError") and "contiguous" in d["non-contiguous out"]
        assert d["non-contiguous lse"].startswith("ValueError") and "partial_lse" in d["non-contiguous lse"]
        assert d["return_lse not bool"].startswith("TypeError")
        assert d["empty"] == "(0, 3, 16)"
        assert d["closed"].startswith("ValueError") and "closed" in d["closed"]


def test_bad_construction_raises_on_every_rank(pools):
    good = _config(2, "direct")
    cases = {
        "heads % W / mismatch": [good, dict(good, heads_per_rank=4)],
        "dtype": [dict(good, dtype=torch.float32)] * 2,
        "lse_base": [dict(good, lse_base=10)] * 2,
        "backend": [dict(good, backend="nccl")] * 2,
        "max_tokens": [dict(good, max_tokens=0)] * 2,
        "max_tokens type": [dict(good, max_tokens=2.5)] * 2,
        "timeout": [dict(good, timeout_s=0)] * 2,
        "timeout inf": [dict(good, timeout_s=float("inf"))] * 2,  # (overflowed after the allocation, leaking it)
        "timeout nan": [dict(good, timeout_s=float("nan"))] * 2,
        "timeout past the bound": [dict(good, timeout_s=2e6)] * 2,
        "one rank timeout inf": [good, dict(good, timeout_s=float("inf"))],
        "vmm on cpu": [dict(good, memory="vmm")] * 2,
        "one rank bad": [good, dict(good, head_dim=-1)],
    }
    for name, per_rank in cases.items():
        res = pools(2).run(fns.bad_construct, per_rank)
        assert all(r.startswith(("ValueError", "TypeError")) for r in res), (name, res)
    res = pools(2).run(fns.bad_construct, cases["heads % W / mismatch"])
    assert all("heads_per_rank" in r and "disagree" in r for r in res), res
    res = pools(2).run(fns.bad_construct, cases["dtype"])
    assert all(r.startswith("TypeError") and "dtype" in r for r in res), res
    res = pools(2).run(fns.bad_construct, cases["one rank bad"])
    assert "head_dim" in res[1] and "rank 1" in res[0], res


@pytest.mark.parametrize("world,absent", [(2, 1), (3, 0)])
def test_missing_peer_raises_timeout(pools, world, absent):
    cfg = _config(world, "direct")
    cfg.pop("timeout_s")
    res = pools(world).run(fns.missing_peer, cfg, absent, 2.0)
    assert res[absent] == {"absent": True}
    for r, d in enumerate(res):
        if r == absent:
            continue
        assert d["first"].startswith(f"rank={r} peer=") and d["first"].endswith("mech=output"), d
        assert d["second"] == d["first"] and d["check"] == "PeerTimeoutError", d  # refuses further calls
        assert 1.0 < d["dt"] < 4 * 2.0, d  # ~ the 2 s timeout once, not once per program of the grid
    # with W = 3 the present ranks may also miss each other's late arrival, but rank `absent` is named
    assert any(f"peer={absent}" in d["first"] for r, d in enumerate(res) if r != absent)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_exact_ties_round_to_even(pools, backend, dtype):
    """Results that are exact ties of the output dtype come out rounded to even on every backend (the
    strict per-element check elsewhere allows one rounding, so it cannot see ties rounded away from zero)."""
    cfg = dict(_config(2, backend, dtype), max_tokens=4)
    res = pools(2).run(fns.rounding_ties, cfg, 5)
    for r in res:
        assert r["backend"] == backend and r["ties"] > 0 and r["mismatch"] == 0, r


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_subnormal_payloads_exact(pools, backend):
    """Subnormal bf16 payloads combine exactly on CPU too (the interpreter's own bf16 conversions get them wrong)."""
    cfg = dict(_config(2, backend), max_tokens=4)
    for r in pools(2).run(fns.subnormal_payloads, cfg, 9):
        assert r["backend"] == backend and r["subnormal"] > 0 and r["mismatch"] == 0, r


def test_ranks_disagreeing_on_T_time_out(pools):
    """A usage error (ranks calling with different T) surfaces as PeerTimeoutError, not as stale inbox rows."""
    res = pools(2).run(fns.mismatched_tokens, _config(2, "direct"), 1.0)
    assert all(r["outcome"] == "PeerTimeoutError mech=output" for r in res), res


def test_auto_falls_back_when_the_allocation_fails(pools):
    """The probe passes, the allocation fails (a full /dev/shm on rank 1): ``auto`` takes a2a on every rank, as
    for an ineligible memory, instead of raising PeerSetupError; nothing stays in /dev/shm."""
    cfg = dict(_config(2, "auto"), memory="auto")
    cases = [dict(T=t, return_lse=bool(i % 2)) for i, t in enumerate([1, 8, 3])]
    res = pools(2).run(fns.auto_when_allocation_fails, cfg, 1, cases, 31)
    _assert_all_ok(res)
    for rows in res:
        assert rows[0]["backend"] == "a2a" and "allocation failed" in rows[0]["reason"], rows[0]
        assert "rank 1" in rows[0]["reason"], rows[0]
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_a2a_combine_offsets_past_2_31(pools):
    """The a2a combine kernel's source offsets in int64: with W = 3 sources of 2^20 - 1 tokens of one 1024-wide
    head, source 2 starts past 2^31 elements (int32 wrapped it ~4 GiB before the buffer: a crash or garbage). Only
    token 0 is touched (the 6.5 GB buffer is never committed). One rank, under the interpreter."""
    res = pools(1).run(fns.a2a_combine_past_2_31)
    assert res[0]["strides"] and res[0]["ok"], res[0]


def test_create_close_cycles_leave_nothing(pools):
    res = pools(2).run(fns.create_close_cycles, _config(2, "direct"), 15)
    for r in res:
        assert r["after"]["fds"] <= r["before"]["fds"], r
        assert r["after"]["maps"] == r["before"]["maps"] == 0, r
    assert glob.glob("/dev/shm/peerdcp-*") == []


def test_cuda_op_is_registered_with_a_fake_implementation():
    """``peerdcp::output_direct`` traces under FakeTensorMode (what torch.compile needs) without CUDA."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    import peerdcp.output.ops  # noqa: F401 - registers the op

    with FakeTensorMode():
        po = torch.empty(2, 4, 8, dtype=torch.bfloat16, device="cuda")
        pl = torch.empty(2, 4, device="cuda")
        out = torch.empty(2, 2, 8, dtype=torch.bfloat16, device="cuda")
        ol = torch.empty(2, 2, device="cuda")
        ep = torch.zeros(3, dtype=torch.int64, device="cuda")
        args = ([1, 2], 0, 0, 3, 1, 8, 0, 0, 1, False, True, 1, 0, 0)
        assert torch.ops.peerdcp.output_direct(po, pl, out, ol, ep, *args) is None
        # with the opt-in / sentinel arguments the reducer passes (opts, LL128 and sentinel fields, split table)
        more = (68, 0, 0, 0, 4096, 8192, 0, [64, 36, 192, 40])
        assert torch.ops.peerdcp.output_direct(po, pl, out, ol, ep, *args, *more) is None


def test_inbox_layout_is_aligned_and_disjoint():
    from peerdcp.output.kernels import InboxLayout

    for H, D, ll in [(16, 512, 8), (3, 24, 4), (32, 512, 0)]:
        L = InboxLayout(2, 264, 512, H, D, 2, ll)
        assert L.flag_off == 0 and L.lse_off >= 2 * 264 * 2 * 8
        assert L.payload_off >= L.lse_off + 2 * 2 * 512 * H * 4
        assert L.ll_off >= L.payload_off + 2 * 2 * 512 * H * D * 2
        assert L.nbytes >= L.ll_off + 2 * 2 * ll * L.ll_row_words * 8
        assert all(o % 256 == 0 for o in (L.lse_off, L.payload_off, L.ll_off))
        assert (L.ll_row_words * 8) % 16 == 0  # LL rows start on 16-byte lines
        assert L.nbytes == L.ll128_off  # no LL128 region unless asked for
    for H, D, T in [(16, 512, 256), (3, 24, 5), (32, 512, 7)]:
        L = InboxLayout(2, 264, T, H, D, 2, 8, ll128_tokens=T)
        assert L.ll128_off >= L.ll_off + 2 * 2 * 8 * L.ll_row_words * 8 and L.ll128_off % 256 == 0
        assert L.ll128_lines * 15 >= H * D // 4 > (L.ll128_lines - 1) * 15  # 15 data words per line
        assert L.ll128_row_words % 16 == 0 and L.ll128_row_words >= L.ll128_lines * 16 + H  # whole lines
        assert L.nbytes >= L.ll128_off + 2 * 2 * T * L.ll128_row_words * 8
    assert InboxLayout(2, 264, 256, 16, 512, 2, 8, ll128_tokens=256).ll128_lines == 137  # Kimi: 2048 words
    for W, H, D, T in [(2, 16, 512, 256), (3, 3, 24, 5), (4, 32, 512, 7)]:  # the sentinel region
        L = InboxLayout(W, 264, T, H, D, 2, 8, ll128_tokens=4, sn_tokens=T)
        assert L.sn_off >= L.ll128_off + 2 * W * 4 * L.ll128_row_words * 8 and L.sn_off % 256 == 0
        assert L.sn_payload_bytes == 2 * W * T * H * D * 2
        assert L.sn_lse_off >= L.sn_off + L.sn_payload_bytes and L.sn_lse_off % 256 == 0
        assert L.nbytes >= L.sn_lse_off + 2 * W * T * H * 16  # two 64-bit LSE words per entry
    L = InboxLayout(2, 264, 256, 16, 512, 2, 8)
    assert L.nbytes == L.sn_off == L.sn_lse_off  # no sentinel region unless asked for


def test_default_ll_range_follows_bytes_per_destination():
    import dataclasses

    from peerdcp.output import policy as P

    policy = dataclasses.replace(P.DEFAULT_POLICY, cuda_ll_max_tokens=8, cuda_ll_max_bytes=65536)

    def ll(h, d, dtype):
        return P.default_ll_max_tokens(h, d, dtype, policy=policy)

    # 64 KiB per destination: 8 heads x 512 bf16 -> 8 tokens, 16 -> 4, 32 -> 2, 64 -> 1, 128 -> no LL
    assert [ll(h, 512, torch.bfloat16) for h in (4, 8, 16, 32, 64, 128)] == [8, 8, 4, 2, 1, 0]
    assert ll(16, 512, torch.float32) == 2  # element bytes count
    assert ll(0, 512, torch.bfloat16) == 8  # bad geometry: the constructor reports it
    assert ll(16, True, torch.bfloat16) == 8
    assert P.default_ll_max_tokens(16, 512, torch.bfloat16) == 4  # the default policy (policy=None)
