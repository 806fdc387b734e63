"""The Query gather in plain torch: the specification every kernel is checked against.

Each rank r of a DCP group of W ranks holds, for the T query tokens of a decode step, its own H heads:

* ``q_nope [T, H, nope]`` bf16 - the absorbed MLA query (``q_nope @ W_UK``), passed through;
* ``q_pe [T, H, rope]`` bf16 - the rotary part, **not yet rotated**.

Attention over the local KV shard needs the *widened* query of all W*H heads, rank-major (widened head
``s*H + h`` is head h of rank s), with RoPE applied and converted to the attention kernel's dtype::

    q [T, W*H (or padded), nope + rope]   nope first, then the rotated part
    q[t, s*H + h, :nope]  = cvt(q_nope_s[t, h, :] * quant_scale)
    q[t, s*H + h, nope:]  = cvt(rope(q_pe_s[t, h, :], cos_sin_cache[positions[t]]) * quant_scale)
    q[t, W*H:, :]         = 0   (padding heads, for FlashMLA's 64 / 128)

``cvt`` is a saturating round-to-nearest-even cast to FP8 ``float8_e4m3fn`` (clamp to +-448 first: torch's
eager cast does not saturate), or a round-to-nearest-even cast to bf16 (then ``quant_scale`` must be 1).

RoPE (``cos_sin_cache [max_pos, rope]`` fp32, row ``[cos_0 .. cos_{d/2-1} | sin_0 .. sin_{d/2-1}]``):

* ``interleaved`` (GPT-J pairs 2i, 2i+1; MLA of DeepSeek/Kimi/GLM):
  ``y[2i] = x[2i]*c_i - x[2i+1]*s_i``, ``y[2i+1] = x[2i]*s_i + x[2i+1]*c_i``
* ``neox`` (pairs i, i+d/2; the DeepSeek-V3.2 indexer):
  ``y[i] = x[i]*c_i - x[i+d/2]*s_i``, ``y[i+d/2] = x[i]*s_i + x[i+d/2]*c_i``

Rounding contract (why the kernels are byte-identical to :func:`widened_query` in fp32): every product and
sum is rounded to fp32 separately, in exactly the order written above (two products, then one add or
subtract, then the ``quant_scale`` product). The Triton kernels are launched with ``enable_fp_fusion=False``
and the CUDA kernel uses ``__fmul_rn``/``__fadd_rn``, so no fused multiply-add changes a rounding.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "FP8_MAX",
    "ROPE_STYLES",
    "apply_rope",
    "convert_out",
    "quantize_fp8",
    "rope_query_rows",
    "widened_query",
    "rope_quantize_kv",
]

FP8_MAX = 448.0
ROPE_STYLES = ("interleaved", "neox")


def apply_rope(
    x: torch.Tensor, cos_sin: torch.Tensor, style: str, *, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Rotate ``x [..., rope]`` by ``cos_sin [..., rope]`` (rows ``[cos | sin]``, broadcastable); in ``dtype``.

    Returns ``[..., rope]`` in ``dtype`` (fp32 for the kernels' contract, fp64 for an exact-math check).
    """
    if style not in ROPE_STYLES:
        raise ValueError(f"rope style must be one of {ROPE_STYLES}, got {style!r}")
    d = x.shape[-1]
    if d % 2 or cos_sin.shape[-1] != d:
        raise ValueError(f"rope dim must be even and match cos_sin_cache ({cos_sin.shape[-1]}), got {d}")
    x = x.to(dtype)
    cos, sin = cos_sin.to(dtype)[..., : d // 2], cos_sin.to(dtype)[..., d // 2 :]
    if style == "interleaved":
        x0, x1 = x[..., 0::2], x[..., 1::2]
    else:
        x0, x1 = x[..., : d // 2], x[..., d // 2 :]
    y0 = x0 * cos - x1 * sin
    y1 = x0 * sin + x1 * cos
    if style == "interleaved":
        return torch.stack((y0, y1), dim=-1).flatten(-2)
    return torch.cat((y0, y1), dim=-1)


def quantize_fp8(x: torch.Tensor, quant_scale: float = 1.0) -> torch.Tensor:
    """Saturating round-to-nearest-even ``float8_e4m3fn`` of ``x * quant_scale`` (multiply in x's dtype).

    NaN stays NaN; +-inf and every magnitude above 448 become +-448.
    """
    y = x * quant_scale if quant_scale != 1.0 else x
    return y.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)


def convert_out(x: torch.Tensor, out_dtype: torch.dtype, quant_scale: float = 1.0) -> torch.Tensor:
    """The output conversion: FP8 (``quant_scale`` applied, saturating) or bf16 (``quant_scale`` must be 1)."""
    if out_dtype == torch.float8_e4m3fn:
        return quantize_fp8(x, quant_scale)
    if out_dtype == torch.bfloat16:
        if quant_scale != 1.0:
            raise ValueError(f"quant_scale applies to FP8 output only; got {quant_scale} with bfloat16 output")
        return x.to(torch.bfloat16)
    raise TypeError(f"out_dtype must be torch.float8_e4m3fn or torch.bfloat16, got {out_dtype}")


def rope_query_rows(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    quant_scale: float = 1.0,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """One rank's heads: ``q_nope [T, H, nope]``, ``q_pe [T, H, rope]`` -> ``[T, H, nope + rope]`` in ``out_dtype``.

    ``compute_dtype`` fp32 is the kernels' exact contract; fp64 is the "true math" the tests bound the
    fp32 result against (within one output step).
    """
    # a position outside the table's rows takes the nearest row, as the kernels do (clamped, never an index error)
    pos = positions.long().clamp(0, cos_sin_cache.shape[0] - 1)
    cs = cos_sin_cache[pos].unsqueeze(1)  # [T, 1, rope]
    pe = apply_rope(q_pe, cs, rope_style, dtype=compute_dtype)
    full = torch.cat((q_nope.to(compute_dtype), pe), dim=-1)
    return convert_out(full, out_dtype, quant_scale)


def widened_query(
    q_nopes: Sequence[torch.Tensor],
    q_pes: Sequence[torch.Tensor],
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    quant_scale: float = 1.0,
    pad_heads_to: int | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The widened query from every rank's shard (lists indexed by rank).

    Args:
        q_nopes: W tensors ``[T, H, nope]`` bf16, rank-major.
        q_pes: W tensors ``[T, H, rope]`` bf16, un-rotated.
        positions: ``[T]`` int, rows of ``cos_sin_cache``.
        cos_sin_cache: ``[max_pos, rope]`` fp32, rows ``[cos | sin]``.
        pad_heads_to: None, or a head count >= W*H; heads ``[W*H, pad)`` are zero.

    Returns:
        ``[T, max(W*H, pad_heads_to), nope + rope]`` in ``out_dtype``.
    """
    rows = [
        rope_query_rows(
            n,
            p,
            positions,
            cos_sin_cache,
            rope_style=rope_style,
            out_dtype=out_dtype,
            quant_scale=quant_scale,
            compute_dtype=compute_dtype,
        )
        for n, p in zip(q_nopes, q_pes)
    ]
    q = torch.cat(rows, dim=1)
    if pad_heads_to is not None and pad_heads_to > q.shape[1]:
        pad = torch.zeros((q.shape[0], pad_heads_to - q.shape[1], q.shape[2]), dtype=q.dtype, device=q.device)
        q = torch.cat((q, pad), dim=1)
    return q


def rope_quantize_kv(
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    *,
    rope_style: str = "interleaved",
    out_dtype: torch.dtype = torch.float8_e4m3fn,
    kv_quant_scale: float = 1.0,
) -> torch.Tensor:
    """This rank's own KV-cache entry for the same tokens: ``k_nope [T, nope]`` (the latent ``c_kv``) and
    un-rotated ``k_pe [T, rope]`` -> ``[T, nope + rope]`` (the FP8 MLA cache layout: 512 nope, then 64 rope).

    SGLang's fused FP8 path (``mla_rope_quantize_fp8``) does this in the same kernel as the query, with
    ``kv_quant_scale = 1 / k_scale``. Same math and rounding as the query rows.
    """
    return rope_query_rows(
        k_nope.unsqueeze(1),
        k_pe.unsqueeze(1),
        positions,
        cos_sin_cache,
        rope_style=rope_style,
        out_dtype=out_dtype,
        quant_scale=kv_quant_scale,
    ).squeeze(1)
