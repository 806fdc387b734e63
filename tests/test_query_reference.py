"""Query reference (plain torch) and RoPE tables: the spec itself, checked against independent math."""

from __future__ import annotations

import pytest
import torch
from on_ranks.query import ordered

from peerdcp.query import reference as R
from peerdcp.query import rope


def test_yarn_parameters_match_the_models():
    assert rope.yarn_correction_range(32, 1, 64, 1e4, 4096) == (10, 23)  # DeepSeek-V3.2
    assert rope.yarn_correction_range(1, 1, 64, 5e4, 4096) == (19, 20)  # Kimi-K2
    assert rope.yarn_softmax_scale(192, 40) == pytest.approx(0.135234, abs=1e-6)
    assert rope.yarn_softmax_scale(192, 64) == pytest.approx(0.144680, abs=1e-6)
    assert rope.PRESETS["deepseek-v3.2"].table_len == 163840
    assert rope.PRESETS["kimi-k2"].table_len == 262144


@pytest.mark.parametrize("preset", ["deepseek-v3.2", "kimi-k2"])
def test_yarn_table_against_fp64_formula(preset):
    p = rope.PRESETS[preset]
    t = rope.cos_sin_cache(preset)
    assert t.shape == (p.table_len, 64) and t.dtype == torch.float32 and t.is_contiguous()
    low, high = rope.yarn_correction_range(p.beta_fast, p.beta_slow, 64, p.theta, p.original_max_pos)
    i = torch.arange(32, dtype=torch.float64)
    f = p.theta ** (-2 * i / 64)
    ramp = ((i - low) / (high - low)).clamp(0, 1)
    f2 = f / p.factor * ramp + f * (1 - ramp)
    assert torch.allclose(f2[: low + 1], f[: low + 1]) and torch.allclose(f2[high:], f[high:] / p.factor)
    for pos in (0, 1, 4095, 4096, 100_000, p.table_len - 1):
        ang = pos * f2
        want = torch.cat([ang.cos(), ang.sin()])
        # the table is fp32 (fp32 frequencies and angles, as SGLang builds it): a few fp32 ulps of the angle
        tol = 2e-7 * max(pos, 1) * 4 + 1e-6
        assert (t[pos].double() - want).abs().max() <= tol, (preset, pos)
    assert t[0, :32].eq(1).all() and t[0, 32:].eq(0).all()


def test_plain_table_and_presets():
    t = rope.plain_cos_sin_cache(100, 16, theta=1e4)
    ang = 7 * (1e4 ** (-torch.arange(0, 16, 2, dtype=torch.float64) / 16))
    assert torch.allclose(t[7].double(), torch.cat([ang.cos(), ang.sin()]), atol=1e-6)
    assert rope.cos_sin_cache("glm-5", max_pos=10).shape == (10, 64)
    with pytest.raises(ValueError, match="unknown RoPE preset"):
        rope.cos_sin_cache("llama")
    with pytest.raises(ValueError, match="rope_dim"):
        rope.plain_cos_sin_cache(10, 15)
    with pytest.raises(ValueError, match="max_pos must be positive"):  # (0 returned the preset's whole table)
        rope.cos_sin_cache("glm-5", max_pos=0)


def test_reference_clamps_positions_as_the_kernels_do():
    """A position outside the table takes its nearest row, as the Triton and CUDA kernels do: -1 is row 0 (not
    the last row), max_pos and beyond the last row (not an IndexError, nor a device assert on GPU)."""
    cs = rope.plain_cos_sin_cache(8, 16)
    gen = torch.Generator().manual_seed(3)
    q_nope = torch.randn(4, 2, 16, generator=gen).to(torch.bfloat16)
    q_pe = torch.randn(4, 2, 16, generator=gen).to(torch.bfloat16)
    got = R.rope_query_rows(q_nope, q_pe, torch.tensor([-1, 0, 8, 100]), cs, out_dtype=torch.bfloat16)
    want = R.rope_query_rows(q_nope, q_pe, torch.tensor([0, 0, 7, 7]), cs, out_dtype=torch.bfloat16)
    assert torch.equal(got, want)


@pytest.mark.parametrize("style", R.ROPE_STYLES)
def test_rope_is_a_rotation_of_the_right_pairs(style):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 64, dtype=torch.float64)
    ang = torch.rand(5, 1, 32, dtype=torch.float64) * 6
    cs = torch.cat([ang.cos(), ang.sin()], dim=-1)
    y = R.apply_rope(x, cs, style, dtype=torch.float64)
    if style == "interleaved":
        z = torch.view_as_complex(x.reshape(5, 3, 32, 2).contiguous())
        want = torch.view_as_real(z * torch.polar(torch.ones_like(ang), ang)).reshape(5, 3, 64)
    else:
        z = torch.complex(x[..., :32], x[..., 32:]) * torch.polar(torch.ones_like(ang), ang)
        want = torch.cat([z.real, z.imag], dim=-1)
    assert torch.allclose(y, want, atol=1e-12)
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1))  # a rotation keeps the norm
    with pytest.raises(ValueError, match="rope style"):
        R.apply_rope(x, cs, "gptj")


def test_fp8_saturates_and_rounds_to_nearest_even():
    x = torch.tensor([448.0, 460.0, 464.0, 1e6, float("inf"), -float("inf"), -500.0, 0.0, -0.0, float("nan")])
    y = R.quantize_fp8(x).float()
    assert y[:7].tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0, -448.0]
    assert y[9].isnan() and not y[:9].isnan().any()
    # every midpoint between adjacent e4m3 values rounds to the one with an even code
    codes = torch.arange(0, 126, dtype=torch.uint8)
    v = codes.view(torch.float8_e4m3fn).float()
    mid = (v + torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()) / 2
    got = R.quantize_fp8(mid).view(torch.uint8)
    assert (got % 2 == 0).all()
    assert R.quantize_fp8(torch.tensor([300.0]), 2.0).float().item() == 448.0
    assert R.convert_out(torch.tensor([1.0]), torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="FP8 output only"):
        R.convert_out(torch.tensor([1.0]), torch.bfloat16, 2.0)
    with pytest.raises(TypeError, match="out_dtype"):
        R.convert_out(torch.tensor([1.0]), torch.float16)


def _outside(q, lo, hi):
    o = ordered(q)
    return (o < ordered(lo)) | (o > ordered(hi))


@pytest.mark.parametrize(
    "out_dtype,scale", [(torch.float8_e4m3fn, 1.0), (torch.float8_e4m3fn, 0.37), (torch.bfloat16, 1.0)]
)
@pytest.mark.parametrize("style", R.ROPE_STYLES)
def test_widened_layout_and_fp32_within_the_fp64_bound(style, out_dtype, scale):
    torch.manual_seed(1)
    W, T, H = 3, 7, 4
    cs = rope.cos_sin_cache("deepseek-v3.2")
    nopes = [torch.randn(T, H, 512).bfloat16() * 4 for _ in range(W)]
    pes = [torch.randn(T, H, 64).bfloat16() * 4 for _ in range(W)]
    pos = torch.randint(0, cs.shape[0], (T,))
    kw = dict(rope_style=style, out_dtype=out_dtype, quant_scale=scale, pad_heads_to=64)
    q32 = R.widened_query(nopes, pes, pos, cs, **kw)
    q64 = R.widened_query(nopes, pes, pos, cs, compute_dtype=torch.float64, **kw)
    lo, hi = R.widened_query_bounds(nopes, pes, pos, cs, **kw)
    assert q32.shape == lo.shape == hi.shape == (T, 64, 576) and q32.dtype == lo.dtype == out_dtype
    assert q32[:, W * H :].float().eq(0).all()
    # rank-major widened heads, nope first (the nope part is just converted)
    for s in range(W):
        want = R.convert_out(nopes[s].float(), out_dtype, scale)
        assert torch.equal(q32[:, s * H : (s + 1) * H, :512].float(), want.float())
        roped = R.apply_rope(pes[s], cs[pos].unsqueeze(1), style)
        assert torch.equal(q32[:, s * H : (s + 1) * H, 512:].float(), R.convert_out(roped, out_dtype, scale).float())
    assert not _outside(q32, lo, hi).any()
    assert float((ordered(q32) == ordered(q64)).float().mean()) >= 0.999
    k = R.rope_quantize_kv(nopes[0][:, 0], pes[0][:, 0], pos, cs, rope_style=style, out_dtype=out_dtype)
    k_ref = R.widened_query([nopes[0][:, :1]], [pes[0][:, :1]], pos, cs, rope_style=style, out_dtype=out_dtype)
    assert k.shape == (T, 576) and torch.equal(k.float(), k_ref[:, 0].float())


@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.bfloat16])
@pytest.mark.parametrize("style", R.ROPE_STYLES)
def test_fp64_bound_holds_under_cancellation_and_catches_a_wrong_step(style, out_dtype):
    """Pairs chosen so x0*c - x1*s (and x0*s + x1*c) nearly cancel: the fp32 result then lies many output steps
    from the fp64 value (no fixed step count bounds it) yet inside ``widened_query_bounds``, whose interval is
    still a single value almost everywhere - so a result one step off where the interval is one value fails."""
    torch.manual_seed(3)
    T, H, d = 16, 8, 64
    cs = rope.plain_cos_sin_cache(4096, d)
    pos = torch.randint(1, 4096, (T,))
    c, s = cs[pos, : d // 2][:, None], cs[pos, d // 2 :][:, None]  # [T, 1, d/2]
    x0 = torch.randn(T, H, d // 2).bfloat16().float()
    x1 = torch.where(torch.rand(T, H, d // 2) < 0.5, x0 * c / s, -x0 * s / c)  # y0 or y1 near 0
    pe = torch.empty(T, H, d)
    if style == "interleaved":
        pe[..., 0::2], pe[..., 1::2] = x0, x1
    else:
        pe[..., : d // 2], pe[..., d // 2 :] = x0, x1
    pes, nopes = [pe.bfloat16()], [torch.randn(T, H, 512).bfloat16()]
    kw = dict(rope_style=style, out_dtype=out_dtype)
    q32 = R.widened_query(nopes, pes, pos, cs, **kw)
    q64 = R.widened_query(nopes, pes, pos, cs, compute_dtype=torch.float64, **kw)
    lo, hi = R.widened_query_bounds(nopes, pes, pos, cs, **kw)
    far = (ordered(q32) - ordered(q64)).abs()
    if out_dtype == torch.bfloat16:  # FP8's 3-bit mantissa and 2^-9 floor absorb the fp32 error
        assert int(far.max()) > 1
    assert not _outside(q32, lo, hi).any()
    width = ordered(hi) - ordered(lo)
    assert (width >= 0).all() and float((width == 0).float().mean()) >= 0.9
    # one element one step off, where the bound is a single value: caught
    t, h, e = (int(i[0]) for i in torch.nonzero((width == 0) & (ordered(q32) > 0), as_tuple=True))
    bad = q32.clone()
    bits = bad.view(torch.uint8 if out_dtype == torch.float8_e4m3fn else torch.int16)
    bits[t, h, e] += 1
    assert int(_outside(bad, lo, hi).sum()) == 1


@pytest.mark.parametrize("seed", range(6))
def test_fp64_bound_holds_over_magnitudes_tables_and_scales(seed):
    """The fp32 contract inside the bound for inputs from 1e-3 to 300 (with saturation and +-inf), both
    styles, both output dtypes, FP8 scales 1, 0.37 and 2, and the YaRN tables."""
    g = torch.Generator().manual_seed(seed)
    cs = rope.cos_sin_cache(("deepseek-v3.2", "kimi-k2")[seed % 2])
    mag = (1e-3, 1.0, 300.0)[seed % 3]
    pos = torch.randint(0, cs.shape[0], (9,), generator=g)
    nopes = [(torch.randn(9, 4, 64, generator=g) * mag).bfloat16() for _ in range(2)]
    pes = [(torch.randn(9, 4, 64, generator=g) * mag).bfloat16() for _ in range(2)]
    nopes[0].view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), 1e30])
    pes[1].view(-1)[:3] = torch.tensor([1e30, -1e30, 3e5])
    for style in R.ROPE_STYLES:
        for out_dtype, scale in ((torch.bfloat16, 1.0), (torch.float8_e4m3fn, 1.0), (torch.float8_e4m3fn, 0.37),
                                 (torch.float8_e4m3fn, 2.0)):  # fmt: skip
            kw = dict(rope_style=style, out_dtype=out_dtype, quant_scale=scale)
            q32 = R.widened_query(nopes, pes, pos, cs, **kw)
            lo, hi = R.widened_query_bounds(nopes, pes, pos, cs, **kw)
            assert not _outside(q32, lo, hi).any(), (style, out_dtype, scale)
            assert float((ordered(hi) == ordered(lo)).float().mean()) >= 0.99, (style, out_dtype, scale)


def test_bounds_check_their_arguments_as_the_reference_does():
    x, cs = torch.zeros(1, 1, 8).bfloat16(), rope.plain_cos_sin_cache(16, 8)
    with pytest.raises(ValueError, match="rope style"):
        R.widened_query_bounds([x], [x], torch.tensor([0]), cs, rope_style="gptj")
    with pytest.raises(ValueError, match="rope dim"):
        R.widened_query_bounds([x], [x[..., :6]], torch.tensor([0]), cs)
