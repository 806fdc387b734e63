"""The DSA indexer's inputs from the model's own projections, and its two scoring formulas.

``index_qkw`` runs the model's ``wq_b``, ``wk``, ``k_norm``, ``weights_proj`` and the family's RoPE (transformers'
functions: NeoX for DeepSeek-V3.2, interleaved for GLM-5) exactly as the model's indexer does. Then either

* ``exact_scores``: the model's fp32 formula ``sum_h w[h] * ReLU(q[h] . k * D^-0.5)`` (transformers' indexer,
  which has no Hadamard rotation and no FP8), or
* ``fp8_inputs``: the real model's FP8 path - the Hadamard rotation on q and k (orthogonal: logits are
  unchanged in exact arithmetic, the FP8 rounding is the model's), power-of-two per-(token, head) and per-token
  scales, the query scales and ``D^-0.5`` folded into the head weights - for ``peerdcp.topk.indexer_logits``.
"""

from __future__ import annotations

import sys

import torch

from ...topk.reference import quantize_k

__all__ = ["index_qkw", "hadamard", "fp8_inputs", "exact_scores"]


def index_qkw(
    indexer: torch.nn.Module, hidden: torch.Tensor, q_resid: torch.Tensor, position_embeddings, rope_style: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [B, S, nh, D]``, ``k [B, S, D]`` (model dtype, roped as the model does) and head weights
    ``w [B, S, nh]`` fp32 (``weights_proj(x) * nh^-0.5``) of a transformers DSA indexer module."""
    if rope_style not in ("neox", "interleaved"):
        raise ValueError(f"index_qkw: rope_style must be 'neox' or 'interleaved', got {rope_style!r}")
    mod = sys.modules[type(indexer).__module__]
    rope = mod.apply_rotary_pos_emb if rope_style == "neox" else mod.apply_rotary_pos_emb_interleave
    B, S, _ = hidden.shape
    nh, D, R = indexer.n_heads, indexer.head_dim, indexer.qk_rope_head_dim
    cos, sin = position_embeddings
    q = indexer.wq_b(q_resid).view(B, S, nh, D)
    q_rot, q_pass = torch.split(q, [R, D - R], dim=-1)
    k = indexer.k_norm(indexer.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [R, D - R], dim=-1)
    q_rot, k_rot = rope(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    w = indexer.weights_proj(hidden.to(indexer.weights_proj.weight.dtype)).float() * nh**-0.5
    return q, k, w


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """Walsh-Hadamard transform over the last dim (a power of two), scaled by ``D^-0.5``: fp32 math, ``x``'s
    dtype out (the DeepSeek-V3.2 ``rotate_activation``)."""
    D = x.shape[-1]
    if D & (D - 1):
        raise ValueError(f"hadamard: the last dim must be a power of two, got {D}")
    y = x.float().reshape(-1, D)
    h = 1
    while h < D:
        y = y.view(-1, D // (2 * h), 2, h)
        y = torch.stack((y[:, :, 0] + y[:, :, 1], y[:, :, 0] - y[:, :, 1]), dim=2)
        h *= 2
    return (y.reshape(x.shape) * D**-0.5).to(x.dtype)


def fp8_inputs(
    q: torch.Tensor, k: torch.Tensor, w: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``q [T, nh, D]``, ``k [N, D]``, ``w [T, nh]`` -> ``q8 [T, nh, D]`` e4m3, folded weights ``[T, nh]`` fp32,
    ``k8 [N, D]`` e4m3, ``k_scale [N]`` fp32 (rotated, then quantized with power-of-two scales)."""
    T, nh, D = q.shape
    q8, q_scale = quantize_k(hadamard(q).reshape(T * nh, D))
    k8, k_scale = quantize_k(hadamard(k))
    return q8.view(T, nh, D), w.float() * q_scale.view(T, nh) * D**-0.5, k8, k_scale


def exact_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The model's fp32 formula: ``q [T, nh, D]``, ``w [T, nh]``, ``keys [T, n, D]`` (each row's keys) ->
    ``[T, n]`` fp32 ``sum_h w[t, h] * ReLU(q[t, h] . keys[t, j] * D^-0.5)``."""
    s = torch.einsum("thd,tnd->thn", q.float(), keys.float()) * q.shape[-1] ** -0.5
    return torch.einsum("th,thn->tn", w.float(), torch.relu(s))
