"""The DCP attention of a transformers MLA/DSA layer: this rank's heads and tokens, peerdcp's three exchanges.

:class:`DCPAttention` replaces a decoder layer's ``self_attn`` (keeping that module's weights) and, per call (the
prompt or one decode token; ``T = B*S`` rows, in chunks of at most ``chunk`` rows, every rank the same)::

    hidden [B, S, hidden]
      -> q_lat [T, H, kv_lora], q_pe [T, H, rope] of this rank's H = heads / W heads (q_b_proj rows, W_UK absorbed)
      --QueryGather (RoPE from the model's rotary table, BF16 or FP8)--> q [T, W*H, kv_lora + rope]
    c_kv, roped k_pe of the call's tokens -> ShardedLatentCache keeps the owned columns, owner (g // I) % W
    DSA, a layer with an indexer: the model's indexer projections; scores of the owned tokens only
         (FP8: IndexKCache owner-sharded + indexer_logits; exact: the model's fp32 formula over the owned keys)
         --TopK.select--> ids [T, topk] global (identical on every rank) --TopK.owned--> local rows
    DSA, a GLM-5 shared layer: the previous layer's ids
    partial attention over the local (selected) latents -> part [T, W*H, kv_lora] bf16, lse [T, W*H]
      --OutputReducer--> [T, H, kv_lora] -> W_UV -> [T, H, v]
    all ranks' heads gathered -> [B, S, heads * v] -> the model's own o_proj

so the output is the whole layer's, on every rank, and everything outside attention stays transformers' code.
Why not ``AttentionInterface``: it is handed the expanded, roped K/V of every token after the model's indexer has
scored all of them; DCP needs the latents of owned tokens, the absorbed query and a sharded indexer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ...output.partial import partial_attention
from ...topk.reference import local_length
from . import mla
from .indexer import index_qkw

__all__ = ["DCPAttention"]


class DCPAttention(mla.LayerAttention):
    """Drop-in ``self_attn`` running DCP over the :class:`~.model.DCPModel`'s group (see the module docstring).

    Args:
        attn: the transformers attention module (its weights are used, not copied).
        layer_idx: the decoder layer's index.
        runtime: the :class:`~.model.DCPModel` holding the peerdcp objects, the options and the checks.
    """

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
        dev, dtype = hidden_states.device, hidden_states.dtype
        past_key_values, layer, past, pos, q_lat, q_pe, q_resid, c_new, pe_new = self._begin(
            hidden_states, position_ids, past_key_values, cache, rt.heads
        )
        c_loc, pe_loc = past_key_values.update(c_new, pe_new, L)  # [B, n_local, *]
        lcols = layer.local_columns()  # [n_local] global columns, ascending
        ids_all = None
        if rt.dsa:
            if self.has_indexer:
                qi, ki, wi = index_qkw(a.indexer, hidden_states, q_resid, position_embeddings, rt.index_style)
                scores_of = self._scorer(layer, qi, ki, wi, B, S, past)
            elif prev_topk_indices is None:
                raise ValueError(f"layer {L} reuses the previous layer's top-k, and none was passed")
            ids_all = torch.empty(B, S, rt.topk, dtype=torch.int32, device=dev)
        out = torch.empty(B, S, rt.H, a.v_head_dim, dtype=dtype, device=dev)
        rows = torch.arange(B * S, device=dev)
        for t0 in range(0, B * S, rt.chunk):
            t = rows[t0 : t0 + rt.chunk]
            b, s = t // S, t % S
            qcol = past + s  # the rows' own global columns
            qn, qp, p = q_lat[b, s].contiguous(), q_pe[b, s].contiguous(), pos[b, s].contiguous()
            q = rt.qg.gather(qn, qp, p, rt.cos_sin)
            rt.checks.query(qn, qp, p, q)
            ok = mla.allowed(attention_mask, b, s, qcol, lcols)  # [T, n_local]
            if rt.dsa:
                lens = qcol + 1
                if self.has_indexer:
                    logits = scores_of(b, s, qcol, ok)
                    ids = rt.tk.select(logits, lens)
                    ids = rt.faults.topk(ids, qcol)
                    rt.checks.topk(logits, lens, ids, past + S)
                else:
                    ids = prev_topk_indices[b, s].contiguous()
                ids_all[b, s] = ids
                sel, _ = rt.tk.owned(ids)
                sel = sel.long()
                idx = sel.clamp(min=0)
                valid = (sel >= 0) & torch.gather(ok, 1, idx)
                c, pe = c_loc[b[:, None], idx], pe_loc[b[:, None], idx]
            else:
                c, pe, valid = c_loc[b], pe_loc[b], ok
            part, lse = partial_attention(q, c, pe, valid, a.scaling)
            part = rt.faults.partial(part)
            merged = rt.red.reduce(part.contiguous(), lse.contiguous())
            rt.checks.merge(part, lse, merged)
            width = rt.topk if rt.dsa else int(local_length(past + S, 0, rt.W, rt.options.interleave))
            rt.checks.attention(q, c, pe, valid, merged, rt.heads, a.scaling, width)
            out[b, s] = mla.value_heads(a, merged, rt.heads, dtype)
        if ids_all is not None:
            rt.log_ids(L, ids_all)
        y = a.o_proj(self._all_heads(out).reshape(B, S, -1))
        return (y, None, ids_all) if rt.returns_topk else (y, None)

    def _all_heads(self, out: torch.Tensor) -> torch.Tensor:
        """``[B, S, H, v]`` of this rank's heads -> ``[B, S, W*H, v]`` of every rank's (rank-major, as the
        heads of ``o_proj``): an all-gather over the group, as bytes (gloo has no bf16)."""
        rt = self.rt
        if rt.W == 1:
            return out
        parts = [torch.empty_like(out) for _ in range(rt.W)]
        dist.all_gather([x.view(torch.uint8) for x in parts], out.contiguous().view(torch.uint8), group=rt.group)
        return torch.cat(parts, dim=2)
