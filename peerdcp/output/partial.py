"""Plain-torch MLA attention over one KV shard: the partial output and LSE that `OutputReducer.reduce` combines.

Shapes (per rank, one decode row per sequence):
    q        [T, Hw, nope + rope]  bf16  (widened heads, nope first, roped part last)
    c_kv     [T, n, nope]          bf16  (latent KV rows of each row's sequence on this rank; also V)
    k_pe     [T, n, rope]          bf16  (roped key part)
    valid    [T, n]                bool  (which of the n rows take part: a shard may be short or empty)
returns
    out      [T, Hw, nope]         bf16  partial output (0 for a row with no valid key)
    lse      [T, Hw]               fp32  natural-log LSE, -inf for a row with no valid key
"""

from __future__ import annotations

import torch

__all__ = ["partial_attention"]


def partial_attention(
    q: torch.Tensor, c_kv: torch.Tensor, k_pe: torch.Tensor, valid: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    nope = c_kv.shape[-1]
    qf = q.float()
    s = torch.einsum("thd,tnd->thn", qf[..., :nope], c_kv.float())
    s = s + torch.einsum("thd,tnd->thn", qf[..., nope:], k_pe.float())
    s = s * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse = torch.logsumexp(s, dim=-1)  # -inf where no valid key
    p = torch.exp(s - torch.where(torch.isinf(lse), torch.zeros_like(lse), lse)[..., None])
    p = torch.where(valid[:, None, :], p, torch.zeros_like(p))
    out = torch.einsum("thn,tnd->thd", p, c_kv.float())
    return out.to(q.dtype if q.dtype in (torch.bfloat16, torch.float16) else torch.bfloat16), lse
