"""The unsharded attention of a transformers MLA/DSA layer: what every DCP rank's result is checked against.

:class:`ReferenceAttention` replaces a layer's ``self_attn`` and computes, from that module's own weights, the same
math as :class:`~.attention.DCPAttention` with no sharding and no exchange: every head, every cached token, one
softmax in fp32. The query is rounded exactly as DCP's is (absorbed in fp32, rounded to bf16, then RoPE and the
output dtype by :func:`peerdcp.query.reference.widened_query`), so the two differ only by what the exchanges owe:
DCP's per-rank partial outputs are bf16 and merged by LSE.

Per call (the prompt, or one decode token; ``T = B*S`` rows, in chunks of ``chunk`` rows)::

    q_lat [T, heads, kv_lora], q_pe [T, heads, rope] --widened_query--> q [T, heads, kv_lora + rope]
    c_kv, k_pe of every token (ShardedLatentCache with W = 1)
    DSA: scores over all causal tokens (the model's fp32 formula, or the FP8 formula over a replicated
         IndexKCache: the same kernel as DCP's, so equal inputs give equal scores), canonical top-k
         (score desc, id asc), or the ids a DCP run recorded (``pinned``: teacher forcing with the selection fixed)
    softmax(q . [c_kv | k_pe] * scale) over the selected, allowed tokens (fp32) -> out_lat bf16 -> W_UV -> o_proj
"""

from __future__ import annotations

import torch

from ...query.reference import widened_query
from ...topk.candidates import canonical_topk
from . import mla
from .indexer import index_qkw

__all__ = ["ReferenceAttention", "attend_fp32"]


def attend_fp32(q: torch.Tensor, c: torch.Tensor, pe: torch.Tensor, ok: torch.Tensor, scale: float) -> torch.Tensor:
    """``q [T, h, kv_lora + rope]``, ``c [T, n, kv_lora]``, ``pe [T, n, rope]``, ``ok [T, n]`` bool ->
    ``[T, h, kv_lora]`` fp32 (0 for a row with no allowed token)."""
    C = c.shape[-1]
    qf = q.float()
    s = torch.einsum("thd,tnd->thn", qf[..., :C], c.float()) + torch.einsum("thd,tnd->thn", qf[..., C:], pe.float())
    s = (s * scale).masked_fill(~ok[:, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return torch.einsum("thn,tnd->thd", p, c.float())


class ReferenceAttention(mla.LayerAttention):
    """Drop-in ``self_attn`` computing the unsharded attention (see the module docstring).

    Args:
        attn: the transformers attention module (its weights are used, not copied).
        layer_idx: the decoder layer's index.
        runtime: the :class:`~.model.ReferenceModel` holding the options, the rotary table, the index caches
            and the logs.
    """

    def __init__(self, attn: torch.nn.Module, layer_idx: int, runtime) -> None:
        super().__init__(attn, layer_idx, runtime)
        self.heads = slice(0, attn.num_heads)

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings=None,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        position_ids: torch.Tensor | None = None,
        prev_topk_indices: torch.Tensor | None = None,
        cache=None,
        **kwargs,
    ):
        rt, a, L = self.rt, self.attn, self.layer_idx
        B, S, _ = hidden_states.shape
        past_key_values, layer, past, pos, q_lat, q_pe, q_resid, c_new, pe_new = self._begin(
            hidden_states, position_ids, past_key_values, cache, self.heads
        )
        c_all, pe_all = past_key_values.update(c_new, pe_new, L)
        n = past + S
        cols = torch.arange(n, device=hidden_states.device)
        ids_all = own_all = pinned = None
        if rt.dsa:
            if self.has_indexer:
                pinned = rt.next_pinned(L, B, S)
                own_all = torch.empty(B, S, rt.topk, dtype=torch.int32, device=hidden_states.device)
                qi, ki, wi = index_qkw(a.indexer, hidden_states, q_resid, position_embeddings, rt.index_style)
                scores_of = self._scorer(layer, qi, ki, wi, B, S, past)
            ids_all = torch.empty(B, S, rt.topk, dtype=torch.int32, device=hidden_states.device)
        out = torch.empty(B, S, a.num_heads, a.v_head_dim, dtype=hidden_states.dtype, device=hidden_states.device)
        rows = torch.arange(B * S, device=hidden_states.device)
        for t0 in range(0, B * S, rt.chunk):
            t = rows[t0 : t0 + rt.chunk]
            b, s = t // S, t % S
            qcol = past + s
            q = widened_query(
                [q_lat[b, s]],
                [q_pe[b, s]],
                pos[b, s],
                rt.cos_sin,
                rope_style=rt.mla_style,
                out_dtype=rt.options.query_dtype,
            )
            ok = mla.allowed(attention_mask, b, s, qcol, cols)
            if rt.dsa:
                if self.has_indexer:
                    own = canonical_topk(scores_of(b, s, qcol, ok), qcol + 1, rt.topk)
                    own_all[b, s] = own
                    ids = own if pinned is None else pinned[b, s]
                else:
                    ids = prev_topk_indices[b, s]
                ids_all[b, s] = ids
                sel = ids.long()
                ok = (sel >= 0) & torch.gather(ok, 1, sel.clamp(min=0))
                c, pe = c_all[b[:, None], sel.clamp(min=0)], pe_all[b[:, None], sel.clamp(min=0)]
            else:
                c, pe = c_all[b], pe_all[b]
            o = attend_fp32(q, c, pe, ok, a.scaling).to(torch.bfloat16)
            out[b, s] = mla.value_heads(a, o, self.heads, hidden_states.dtype)
        if ids_all is not None:
            rt.log_ids(L, own_all if own_all is not None else ids_all)
        y = a.o_proj(out.reshape(B, S, -1))
        return (y, None, ids_all) if rt.returns_topk else (y, None)
