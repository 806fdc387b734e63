"""Property-based checks (hypothesis) of the specifications and of the canonical top-k kernel.

The mechanism suites test kernels against the references on chosen adversarial cases; these tests let
hypothesis search the input space of the conventions themselves: token ownership and its inverse, the
LSE combine (empty / NaN / +inf sources, shifts), and the canonical top-k order (ties, NaN, -0 / +0,
+-inf, short sequences) against a brute-force sort.
"""

from __future__ import annotations

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from on_ranks import properties as fns

from peerdcp.output import reference as oref
from peerdcp.topk import reference as tref

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(W=st.integers(1, 8), I=st.sampled_from([1, 2, 3, 64]), L=st.integers(0, 700))
def test_ownership_is_a_bijection(W, I, L):
    g = torch.arange(L)
    r = tref.owner(g, W, I)
    l = tref.local_row(g, W, I)
    assert torch.equal(tref.global_id(l, r, W, I), g) if L else True
    for rank in range(W):
        rows = l[r == rank]
        # each rank's tokens fill its local rows 0 .. local_length-1 in increasing global order
        assert torch.equal(rows, torch.arange(rows.numel()))
        assert int(tref.local_length(L, rank, W, I)) == rows.numel()


_LSE = st.one_of(
    st.floats(-80, 80, allow_nan=False),
    st.sampled_from([float("-inf"), float("inf"), float("nan"), 1e4, -1e4]),
)


def _combine_by_hand(outs, lses, base):
    """Independent scalar implementation of DESIGN.md section 3's combine (Python floats)."""
    N, R, D = outs.shape
    out = torch.zeros(R, D, dtype=torch.float64)
    lse = torch.full((R,), float("-inf"), dtype=torch.float64)
    b = math.e if base == "e" else 2.0
    for r in range(R):
        ls = [float(lses[i, r]) for i in range(N)]
        ls = [x if (not math.isnan(x) and x != math.inf) else -math.inf for x in ls]
        m = max(ls)
        if m == -math.inf:
            continue
        w = [b ** (x - m) if x != -math.inf else 0.0 for x in ls]
        S = sum(w)
        for i in range(N):
            if w[i] > 0:
                out[r] += (w[i] / S) * outs[i, r].double()
        lse[r] = m + math.log(S, b)
    return out, lse


@SETTINGS
@given(
    N=st.integers(1, 5),
    R=st.integers(1, 6),
    base=st.sampled_from(["e", 2]),
    data=st.data(),
)
def test_combine_reference_matches_the_formula(N, R, base, data):
    lses = torch.tensor([[data.draw(_LSE) for _ in range(R)] for _ in range(N)], dtype=torch.float64)
    outs = torch.randn(N, R, 8, dtype=torch.float64)
    empty = torch.isnan(lses) | (lses == math.inf) | (lses == -math.inf)
    outs[empty] = float("nan")  # a source with weight 0 must never be read
    got, got_lse = oref.combine(outs, lses, lse_base=base, return_lse=True)
    want, want_lse = _combine_by_hand(outs, lses, "e" if base == "e" else 2)
    assert not torch.isnan(got).any() and not torch.isnan(got_lse).any()
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(got_lse, want_lse, rtol=1e-12, atol=1e-9)
    # shifting every LSE of a row by c leaves the output alone and shifts the merged LSE by c
    c = data.draw(st.floats(-30, 30))
    shifted, shifted_lse = oref.combine(outs, lses + c, lse_base=base, return_lse=True)
    torch.testing.assert_close(shifted, got, rtol=1e-9, atol=1e-12)
    finite = torch.isfinite(got_lse)
    torch.testing.assert_close(shifted_lse[finite], got_lse[finite] + c, rtol=1e-12, atol=1e-9)


_SCORE = st.sampled_from([float("nan"), float("-inf"), -2.5, -0.0, 0.0, 1.0, 1.0, 3.25, float("inf")])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(T=st.integers(1, 3), L=st.integers(1, 90), k=st.sampled_from([1, 4, 16, 64]), data=st.data())
def test_canonical_topk_kernel_matches_bruteforce(pools, T, L, k, data):
    logits = [[data.draw(_SCORE) for _ in range(L)] for _ in range(T)]
    lens = [data.draw(st.integers(0, L)) for _ in range(T)]
    ok, why = pools(1).run(fns.topk_matches_bruteforce, logits, lens, k)[0]
    assert ok, why


_BF16_FINITE = st.integers(0, 0xFFFF).filter(lambda b: (b & 0x7F80) != 0x7F80)  # every finite bf16 bit pattern


@SETTINGS
@given(
    bits=st.lists(_BF16_FINITE, min_size=16, max_size=16),
    pos=st.integers(0, 4095),
    style=st.sampled_from(["interleaved", "neox"]),
    out=st.sampled_from([(torch.bfloat16, 1.0), (torch.float8_e4m3fn, 1.0), (torch.float8_e4m3fn, 0.37),
                         (torch.float8_e4m3fn, 2.0 ** -12)]),
)  # fmt: skip
def test_query_fp32_contract_lies_within_the_fp64_bound(bits, pos, style, out):
    """``widened_query_bounds`` brackets the fp32 contract for any finite bf16 inputs (subnormals, the largest
    values whose products overflow fp32, zeros of either sign), any table row and scale."""
    from peerdcp.query import reference as qref
    from peerdcp.query.rope import plain_cos_sin_cache

    x = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    nope, pe = x[:8].reshape(1, 1, 8), x[8:].reshape(1, 1, 8)
    cs = plain_cos_sin_cache(4096, 8)
    kw = dict(rope_style=style, out_dtype=out[0], quant_scale=out[1])
    q = qref.widened_query([nope], [pe], torch.tensor([pos]), cs, **kw)
    lo, hi = qref.widened_query_bounds([nope], [pe], torch.tensor([pos]), cs, **kw)
    from on_ranks.query import ordered as o

    assert not q.float().isnan().any()
    assert ((o(lo) <= o(q)) & (o(q) <= o(hi))).all(), (q, lo, hi)


_BF16_MODEST = _BF16_FINITE.filter(lambda b: (b & 0x7F80) < ((127 + 100) << 7))  # |x| < 2^101: no fp32 overflow


@SETTINGS
@given(
    N=st.integers(1, 5),
    R=st.integers(1, 4),
    base=st.sampled_from(["e", 2]),
    dtype=st.sampled_from([torch.bfloat16, torch.float16]),
    data=st.data(),
)
def test_output_fp32_combine_lies_within_the_fp64_bound(N, R, base, dtype, data):
    """``combine_bounds`` brackets an fp32 combine (``combine(..., compute_dtype=float32)``) for any LSEs
    (empty, NaN, +inf, gaps of 1e4) and any bf16 payloads below fp32 overflow (subnormals, zeros of either
    sign, cancelling sources), with the output rounded to bf16 or fp16."""
    lses = torch.tensor([[data.draw(_LSE) for _ in range(R)] for _ in range(N)], dtype=torch.float32)
    bits = data.draw(st.lists(_BF16_MODEST, min_size=N * R * 8, max_size=N * R * 8))
    outs = torch.tensor(bits, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(N, R, 8)
    got, got_lse = oref.combine(outs, lses, lse_base=base, return_lse=True, compute_dtype=torch.float32)
    lo, hi, lse_lo, lse_hi = oref.combine_bounds(outs, lses, lse_base=base, out_dtype=dtype)
    q = got.to(dtype)
    assert not oref.outside_bounds(q, lo, hi).any(), (q, lo, hi)
    assert not oref.outside_bounds(got_lse, lse_lo, lse_hi).any()  # an all-empty row: -inf alone
