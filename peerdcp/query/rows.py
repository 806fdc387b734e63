"""Row helpers of the Query gather's Triton kernels (``kernels.py``): the numerics of a unit's row (bf16 ->
fp32 -> e4m3 / bf16 bits, RoPE) and the row loads, stores and copies every kernel shares, so every path rounds
identically. All are ``@triton.jit`` functions, inlined into the kernels that call them; the module docstring of
``kernels.py`` describes the row math and the buffer layout they address.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .._runtime.device import cast_rne, to_f32


# ------------------------------------------------------------------------------------------ numerics
@triton.jit
def _f32_to_e4m3_bits(v):
    """Saturating round-to-nearest-even fp32 -> float8_e4m3fn code (in int32), for the interpreter.

    Normal range (|x| >= 2^-6): round the fp32 bits at mantissa bit 20 (ties to even) and rebias the
    exponent (127 -> 7). Below: k = RNE(|x| * 2^9) subnormal steps, by the fp32 magic-number add
    (exact IEEE fp32 arithmetic in numpy; never used on the GPU, where ``cvt.rn.satfinite`` does it all).
    |x| is first clamped to 448 (the largest e4m3fn value); NaN -> 0x7F; the sign is kept (-0.0 -> 0x80).
    """
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    code_n = ((tl.minimum(a, 0x43E00000) + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    small = tl.minimum(a, 0x3C800000).to(tl.float32, bitcast=True)  # clamped: no inf/NaN on this path
    code_s = ((small * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    code = tl.where(a >= 0x3C800000, code_n, code_s)
    code = tl.where(a > 0x7F800000, 0x7F, code)
    return code | sign


@triton.jit
def _cvt(v, quant_scale, OUT_FP8: tl.constexpr, GPU: tl.constexpr):
    """fp32 -> output bits: uint8 e4m3 code of ``v * quant_scale`` (saturating), or int16 bf16 bits."""
    if OUT_FP8:
        y = v * quant_scale
        if GPU:
            # cvt.rn.satfinite.e4m3x2.f32: RNE, saturates to +-448, NaN stays NaN
            return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        else:
            return _f32_to_e4m3_bits(y).to(tl.uint8)
    else:
        return cast_rne(v, tl.bfloat16, GPU).to(tl.int16, bitcast=True)


@triton.jit
def _rows_compute(
    nope_base,
    nope_off,
    pe_base,
    pe_off,
    cs_base,
    cs_off,
    mask_u,
    quant_scale,
    BU: tl.constexpr,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
    NEOX: tl.constexpr,
    OUT_FP8: tl.constexpr,
    GPU: tl.constexpr,
    CG: tl.constexpr,
):
    """Output bits of BU units from their bf16 rows.

    ``*_base`` are scalar pointers (bf16, bf16, fp32), ``*_off`` int64 ``[BU]`` element offsets of each
    unit's nope row, pe row and cos/sin row. Returns ``(nope_bits [BU, NB], pe_bits [BU, ROPE])`` (uint8
    e4m3 codes or int16 bf16 bits), pe in element order; ``CG`` loads bypass L1 (peer rows after an acquire).
    The pe row is loaded contiguously and split into the pair members: interleaved (2i, 2i+1) by a
    [ROPE/2, 2] view, NeoX (i, i + ROPE/2) by a [2, ROPE/2] view.
    """
    HALF: tl.constexpr = ROPE // 2
    on = tl.arange(0, NB)
    mn = mask_u[:, None] & (on[None, :] < NOPE)
    if OUT_FP8:
        xn = tl.load(nope_base + nope_off[:, None] + on[None, :], mask=mn, other=0.0, cache_modifier=CG)
        nope_bits = _cvt(to_f32(xn, GPU), quant_scale, OUT_FP8, GPU)
    else:
        # bf16 out: the nope part passes through bit for bit
        nb16 = nope_base.to(tl.pointer_type(tl.int16))
        nope_bits = tl.load(nb16 + nope_off[:, None] + on[None, :], mask=mn, other=0, cache_modifier=CG)
    orr = tl.arange(0, ROPE)
    xp = tl.load(pe_base + pe_off[:, None] + orr[None, :], mask=mask_u[:, None], other=0.0, cache_modifier=CG)
    xp = to_f32(xp, GPU)
    if NEOX:
        x0, x1 = tl.split(tl.permute(tl.reshape(xp, (BU, 2, HALF)), (0, 2, 1)))
    else:
        x0, x1 = tl.split(tl.reshape(xp, (BU, HALF, 2)))
    ih = tl.arange(0, HALF)
    c = tl.load(cs_base + cs_off[:, None] + ih[None, :], mask=mask_u[:, None], other=0.0)
    s = tl.load(cs_base + cs_off[:, None] + HALF + ih[None, :], mask=mask_u[:, None], other=0.0)
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    if NEOX:
        y = tl.reshape(tl.permute(tl.join(y0, y1), (0, 2, 1)), (BU, ROPE))
    else:
        y = tl.reshape(tl.join(y0, y1), (BU, ROPE))
    return nope_bits, _cvt(y, quant_scale, OUT_FP8, GPU)


@triton.jit
def _slot_pointer(base, data_off, slot, slot_bytes):
    """The parity / Z slot of the rank whose int8 base address is ``base``, declared 16-byte aligned (it is: the
    allocation is page aligned, ``data_off`` and ``slot_bytes`` are multiples of 256). Why the hint is needed, not
    only allowed: Triton 3.6 on sm_90 stores an FP8 row's RoPE part (a uint8 tile built by ``tl.join`` /
    ``tl.reshape`` in :func:`_rows_compute`) wrongly through a pointer of unknown alignment - bytes 0-1 of every 4
    lost with rope_dim >= 128 (``scripts/diag/query_mismatch.py`` (in git history) shows it) - while the same values
    stored
    through the 16-byte aligned ``out`` are right; with the hint both stores take the vectorized path."""
    return tl.multiple_of(base + data_off + slot * slot_bytes.to(tl.int64), 16)


@triton.jit
def _rows_store(
    dst_base,
    dst_off,
    mask_u,
    nope_bits,
    pe_bits,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
):
    """Store output bits of BU units at rows ``dst_base + dst_off`` (``[nope | rope]``, D elements each)."""
    on = tl.arange(0, NB)
    mn = mask_u[:, None] & (on[None, :] < NOPE)
    tl.store(dst_base + dst_off[:, None] + on[None, :], nope_bits, mask=mn)
    orr = tl.arange(0, ROPE)
    tl.store(dst_base + dst_off[:, None] + NOPE + orr[None, :], pe_bits, mask=mask_u[:, None])


@triton.jit
def _rows_copy(
    src_base,
    src_off,
    dst_base,
    dst_off,
    mask_u,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
    RB: tl.constexpr,
    CG: tl.constexpr,
):
    """Copy BU finished rows (D = NOPE + ROPE elements of the output type) from ``src`` to ``dst``."""
    on = tl.arange(0, NB)
    mn = mask_u[:, None] & (on[None, :] < NOPE)
    x = tl.load(src_base + src_off[:, None] + on[None, :], mask=mn, other=0, cache_modifier=CG)
    tl.store(dst_base + dst_off[:, None] + on[None, :], x, mask=mn)
    orr = tl.arange(0, RB)
    mr = mask_u[:, None] & (orr[None, :] < ROPE)
    y = tl.load(src_base + src_off[:, None] + NOPE + orr[None, :], mask=mr, other=0, cache_modifier=CG)
    tl.store(dst_base + dst_off[:, None] + NOPE + orr[None, :], y, mask=mr)


@triton.jit
def _rows_copy_raw(
    nope_src,
    nope_soff,
    pe_src,
    pe_soff,
    nope_dst,
    nope_doff,
    pe_dst,
    pe_doff,
    mask_u,
    NOPE: tl.constexpr,
    ROPE: tl.constexpr,
    NB: tl.constexpr,
    RB: tl.constexpr,
):
    """Copy BU raw bf16 units (as int16 bits) from the caller's tensors into this rank's slot."""
    on = tl.arange(0, NB)
    mn = mask_u[:, None] & (on[None, :] < NOPE)
    x = tl.load(nope_src + nope_soff[:, None] + on[None, :], mask=mn, other=0)
    tl.store(nope_dst + nope_doff[:, None] + on[None, :], x, mask=mn)
    orr = tl.arange(0, RB)
    mr = mask_u[:, None] & (orr[None, :] < ROPE)
    y = tl.load(pe_src + pe_soff[:, None] + orr[None, :], mask=mr, other=0)
    tl.store(pe_dst + pe_doff[:, None] + orr[None, :], y, mask=mr)


@triton.jit
def _zero_rows(dst_base, dst_off, mask_u, D: tl.constexpr, NB: tl.constexpr, RB: tl.constexpr, NOPE: tl.constexpr):
    """Store zeros into BU rows of D elements at ``dst_base + dst_off``."""
    on = tl.arange(0, NB)
    mn = mask_u[:, None] & (on[None, :] < NOPE)
    zn = (dst_off[:, None] * 0 + on[None, :] * 0).to(dst_base.dtype.element_ty)
    tl.store(dst_base + dst_off[:, None] + on[None, :], zn, mask=mn)
    orr = tl.arange(0, RB)
    mr = mask_u[:, None] & (orr[None, :] < D - NOPE)
    zr = (dst_off[:, None] * 0 + orr[None, :] * 0).to(dst_base.dtype.element_ty)
    tl.store(dst_base + dst_off[:, None] + NOPE + orr[None, :], zr, mask=mr)


@triton.jit
def _pad_rows(
    out,
    p,
    T,
    HW: tl.constexpr,
    HOUT: tl.constexpr,
    D: tl.constexpr,
    NOPE: tl.constexpr,
    NB: tl.constexpr,
    RB: tl.constexpr,
    BU: tl.constexpr,
    NPROG,
):
    """Zero the padding heads ``[HW, HOUT)`` of every token; program p takes every NPROG-th block."""
    NPAD: tl.constexpr = HOUT - HW
    if NPAD > 0:
        n = T * NPAD
        PB: tl.constexpr = 4 * BU  # rows per step
        j0 = p * PB
        while j0 < n:
            j = j0 + tl.arange(0, PB)
            m = j < n
            t = (j // NPAD).to(tl.int64)
            hp = HW + j % NPAD
            _zero_rows(out, (t * HOUT + hp) * D, m, D, NB, RB, NOPE)
            j0 += NPROG * PB
