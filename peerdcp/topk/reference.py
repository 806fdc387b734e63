"""The specification of the indexer / Top-K mechanism, in plain torch (brute force, fp64 where it matters).

Nothing here is fast and nothing touches peer memory: the kernels and the public classes are checked
against these functions. Conventions (DESIGN.md section 3, notes/dsa-query-topk.md sections 3-4):

* **Token ownership** with interleave ``I`` over ``W`` ranks: global token ``g`` lives on rank
  ``(g // I) % W`` at local row ``(g // (I*W))*I + g % I``; inverse ``g = (l // I)*W*I + r*I + l % I``.
  The local length of a sequence of ``L`` tokens on rank ``r`` is the number of owned ``g < L``. ``g`` is
  strictly increasing in ``l`` on every rank, so "lowest local row" is "lowest global id".
* **Index score** ``I(t, s) = k_scale[s] * sum_h ReLU(q8[t, h, :] . k8[s, :]) * w[t, h]`` (fp32 result),
  over FP8 e4m3 keys with one power-of-two scale per token and the per-(token, head) query scale already
  folded into ``w``.
* **Key quantization** (DeepSeek ``act_quant``, ``scale_fmt="ue8m0"``, block 128 = one token):
  ``s = 2^ceil(log2(max(amax, 1e-4) / 448))``, ``k8 = e4m3_RNE(clamp(k / s, +-448))``; ``ceil(log2 .)`` is
  taken from the exponent bits of the fp32 quotient, so the scale is bit-exact.
* **Canonical top-k order**: score descending, then global id ascending; NaN ranks below every number
  (including -inf); -0.0 equals +0.0. The selected *set* is exact under ties; the returned row is sorted
  in that order and padded with -1 (``int32 [T, k]``). A sequence shorter than ``k`` selects all its tokens.
* **Force-included tokens**: the first ``force_first`` and the last ``force_last`` tokens of each sequence
  are scored +inf before the selection (an init window and a local window always attended).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "FP8_MAX",
    "owner",
    "local_row",
    "global_id",
    "local_length",
    "local_to_global",
    "quantize_k",
    "index_scores",
    "index_scores_abs",
    "canonical_order",
    "canonical_topk",
    "select_reference",
    "candidates_reference",
    "owned_reference",
    "pack_keys",
    "ordered_bits",
]

FP8_MAX = 448.0


# ------------------------------------------------------------------------------------------- ownership
def owner(g, W: int, I: int = 1):
    """Rank that owns global token ``g`` (int or integer tensor)."""
    return (g // I) % W


def local_row(g, W: int, I: int = 1):
    """Row of global token ``g`` in its owner's local cache."""
    return (g // (I * W)) * I + g % I


def global_id(l, r: int, W: int, I: int = 1):
    """Inverse of (owner, local_row): global id of local row ``l`` on rank ``r``."""
    return (l // I) * W * I + r * I + l % I


def local_length(L, r: int, W: int, I: int = 1):
    """How many of the tokens ``0 .. L-1`` rank ``r`` owns (int or integer tensor ``L``)."""
    full = L // (I * W)
    rem = L % (I * W) - r * I
    if isinstance(rem, torch.Tensor):
        rem = rem.clamp(0, I)
    else:
        rem = min(max(rem, 0), I)
    return full * I + rem


def local_to_global(global_rows: torch.Tensor, r: int, W: int, I: int = 1, L_local: int | None = None) -> torch.Tensor:
    """Rank ``r``'s view of per-row global data: ``out[..., l] = global_rows[..., global_id(l)]``.

    ``global_rows [..., L]``; local rows whose global id is ``>= L`` are filled with NaN (float) or -1.
    ``L_local`` defaults to the local length of ``L`` on rank 0 (the largest over ranks).
    """
    L = global_rows.shape[-1]
    n = local_length(L, 0, W, I) if L_local is None else L_local
    g = global_id(torch.arange(n), r, W, I)
    fill = float("nan") if global_rows.is_floating_point() else -1
    out = torch.full((*global_rows.shape[:-1], n), fill, dtype=global_rows.dtype)
    ok = g < L
    out[..., ok] = global_rows[..., g[ok]]
    return out


# ---------------------------------------------------------------------------------------- quantization
def _pow2_ceil_exponent(x: torch.Tensor) -> torch.Tensor:
    """``ceil(log2(x))`` for positive normal fp32 ``x``, from the exponent bits (exact)."""
    bits = x.to(torch.float32).view(torch.int32).to(torch.int64)
    exp = ((bits >> 23) & 0xFF) - 127
    mant = bits & 0x7FFFFF
    return exp + (mant != 0).to(torch.int64)


def quantize_k(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token power-of-two FP8 quantization of index keys.

    Args:
        k: ``[N, D]`` float (bf16/fp16/fp32) un-quantized keys (after RoPE and the Hadamard rotation).

    Returns:
        ``k_fp8 [N, D]`` float8_e4m3fn and ``k_scale [N]`` fp32 (a power of two), with
        ``k ~= k_fp8.float() * k_scale[:, None]``.
    """
    x = k.to(torch.float32)
    amax = x.abs().amax(dim=-1).clamp_min(1e-4)
    e = _pow2_ceil_exponent(amax / FP8_MAX)
    scale = ((e + 127) << 23).to(torch.int32).view(torch.float32)
    # x / scale is exact (scale is a power of two) and |x / scale| <= 448 by construction; the clamp is
    # there because torch's eager cast does not saturate.
    q = (x / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


# ------------------------------------------------------------------------------------------- scoring
def index_scores(
    q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """Lightning-indexer scores of every query row against every key.

    Args:
        q_fp8: ``[T, H, D]`` float8_e4m3fn queries.
        weights: ``[T, H]`` fp32 head weights (query scales folded in).
        k_fp8: ``[S, D]`` float8_e4m3fn keys; ``k_scale``: ``[S]`` fp32.

    Returns:
        ``[T, S]`` fp32. The head dot products are exact in fp64 (FP8 x FP8 products have 8 significant
        bits and a 36-bit exponent span), the weighted head sum is fp64, and the result is rounded once.
    """
    dots = torch.einsum("thd,sd->ths", q_fp8.double(), k_fp8.double())
    s = (dots.clamp_min(0) * weights.double()[:, :, None]).sum(dim=1)
    return (s * k_scale.double()[None, :]).to(torch.float32)


def index_scores_abs(
    q_fp8: torch.Tensor, weights: torch.Tensor, k_fp8: torch.Tensor, k_scale: torch.Tensor
) -> torch.Tensor:
    """``|k_scale[s]| * sum_h |w[t, h]| * sum_d |q8[t, h, d] * k8[s, d]|`` (fp64): the scale that any
    summation order's rounding error is proportional to (error bounds of a kernel are relative to it)."""
    dots = torch.einsum("thd,sd->ths", q_fp8.double().abs(), k_fp8.double().abs())
    s = (dots * weights.double().abs()[:, :, None]).sum(dim=1)
    return s * k_scale.double().abs()[None, :]


# ------------------------------------------------------------------------------------- canonical top-k
def canonical_order(scores: torch.Tensor, ids: torch.Tensor) -> list[int]:
    """``ids`` sorted canonically by ``scores`` (1-D, same length): score descending, then id ascending,
    NaN last, -0.0 == +0.0. Brute force with Python's sort on ``(is_nan, -score, id)``."""
    pairs = [(float(s), int(i)) for s, i in zip(scores.tolist(), ids.tolist())]
    # -(-0.0) == 0.0 compares equal to -(+0.0); NaN goes to the end through the first tuple item.
    pairs.sort(key=lambda p: (math.isnan(p[0]), 0.0 if math.isnan(p[0]) else -p[0], p[1]))
    return [i for _, i in pairs]


def canonical_topk(scores: torch.Tensor, k: int) -> list[int]:
    """The first ``k`` ids (``0 .. len-1``) of ``scores [L]`` in canonical order (all of them if ``L < k``)."""
    return canonical_order(scores, torch.arange(scores.numel()))[:k]


def select_reference(
    global_logits: torch.Tensor,
    seq_lens: torch.Tensor,
    k: int,
    *,
    force_first: int = 0,
    force_last: int = 0,
) -> torch.Tensor:
    """The exact global selection: ``int32 [T, k]``, canonical order, -1 padded.

    Args:
        global_logits: ``[T, >= max(seq_lens)]`` fp32 scores by global token id (entries at or past a
            row's length are ignored).
        seq_lens: ``[T]`` global sequence lengths.
        k: how many tokens to keep per row.
        force_first, force_last: this many first / last tokens of each row are scored +inf.
    """
    T = global_logits.shape[0]
    out = torch.full((T, k), -1, dtype=torch.int32)
    for t in range(T):
        L = int(seq_lens[t])
        s = global_logits[t, :L].to(torch.float32).clone()
        g = torch.arange(L)
        s[(g < force_first) | (g >= L - force_last)] = float("inf")
        sel = canonical_topk(s, k)
        out[t, : len(sel)] = torch.tensor(sel, dtype=torch.int32)
    return out


def candidates_reference(
    local_logits: torch.Tensor,
    seq_lens: torch.Tensor,
    k: int,
    r: int,
    W: int,
    I: int = 1,
    *,
    force_first: int = 0,
    force_last: int = 0,
) -> torch.Tensor:
    """Rank ``r``'s local candidates (stage 1 of the two-stage selection): ``int64 [T, max(1, min(k, L))]``
    :func:`pack_keys` of its owned tokens, descending (= canonical order), -1 tail.

    Args:
        local_logits: ``[T, L]`` fp32 scores by local row (columns at or past a row's local length ignored).
        seq_lens: ``[T]`` global sequence lengths.
        k, r, W, I: top-k, this rank, world size, interleave; ``force_first`` / ``force_last`` as in
            :func:`select_reference` (by global id).
    """
    T, L = local_logits.shape
    out = torch.full((T, max(1, min(k, L))), -1, dtype=torch.int64)
    for t in range(T):
        seq = int(seq_lens[t])
        n = min(int(local_length(seq, r, W, I)), L)
        g = global_id(torch.arange(n), r, W, I)
        s = local_logits[t, :n].to(torch.float32).clone()
        s[(g < force_first) | (g >= seq - force_last)] = float("inf")
        keys = pack_keys(s, g).sort(descending=True).values[: out.shape[1]]
        out[t, : keys.numel()] = keys
    return out


def owned_reference(ids: torch.Tensor, r: int, W: int, I: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``r``'s part of a selection ``ids [T, k]``: its local rows in selection order, compacted to the
    front with a -1 tail (``int32 [T, k]``), and the counts (``int32 [T]``)."""
    T, k = ids.shape
    rows = torch.full((T, k), -1, dtype=torch.int32)
    counts = torch.zeros(T, dtype=torch.int32)
    for t in range(T):
        mine = [int(local_row(g, W, I)) for g in ids[t].tolist() if g >= 0 and owner(g, W, I) == r]
        rows[t, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        counts[t] = len(mine)
    return rows, counts


# ------------------------------------------------------------------------------------------ key packing
def ordered_bits(scores: torch.Tensor) -> torch.Tensor:
    """fp32 scores -> int64 in ``[0, 2^32)`` whose integer order is the canonical score order.

    ``bits ^ (sign ? 0xFFFFFFFF : 0x80000000)`` maps the float order to unsigned order; -0.0 is mapped to
    +0.0 first and NaN (any sign or payload) to 0, below -inf (which maps to 0x007FFFFF).
    """
    s = scores.to(torch.float32)
    s = torch.where(s == 0, torch.zeros_like(s), s)
    bits = s.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    neg = bits >= 0x80000000
    ordered = torch.where(neg, bits ^ 0xFFFFFFFF, bits ^ 0x80000000)
    return torch.where(torch.isnan(s), torch.zeros_like(ordered), ordered)


def pack_keys(scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Unique int64 keys whose descending integer order is the canonical order: ``ordered << 31 |
    (2^31 - 1 - id)`` for ``0 <= id < 2^31 - 1``. Every such key is >= 1; -1 marks "no candidate"."""
    return (ordered_bits(scores) << 31) | (0x7FFFFFFF - ids.to(torch.int64))
