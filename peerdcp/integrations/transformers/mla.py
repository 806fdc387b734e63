"""The MLA pieces both attention modules compute from a transformers attention module's own weights.

Names follow DESIGN.md: ``c_kv`` the latent (``kv_lora`` wide, 512 in DeepSeek-V3.2), ``k_pe`` the shared roped key
(``rope``, 64), ``W_UK [heads, nope, kv_lora]`` and ``W_UV [heads, v, kv_lora]`` the two halves of ``kv_b_proj``.
The query is absorbed (``q_lat = q_nope @ W_UK``, computed in fp32 and rounded once to bf16), so attention scores
are ``q_lat . c_kv + q_pe . k_pe`` and the output is ``(sum_j p_j c_kv_j) @ W_UV^T``: the decode form a serving
engine runs, and the one whose query DCP gathers.

RoPE uses peerdcp's layout (:func:`peerdcp.query.reference.apply_rope`, pairs kept in place) for the query and
``k_pe`` alike; transformers' interleaved RoPE returns the rotated pairs de-interleaved (evens, then odds) for both,
a permutation of the same dimensions, so every dot product is the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...query.reference import apply_rope
from .indexer import exact_scores, fp8_inputs

__all__ = ["LayerAttention", "query_heads", "latents", "value_heads", "allowed", "mla_rope_style", "index_rope_style"]


class LayerAttention(torch.nn.Module):
    """What the DCP and the reference attention share: the transformers module they stand in for (its weights are
    used, not copied), the layer's index, the runtime (the model wrapper holding the options and the peerdcp
    objects), and the first steps of a call, up to the new tokens' latents."""

    def __init__(self, attn: torch.nn.Module, layer_idx: int, runtime) -> None:
        super().__init__()
        self.attn = attn
        self.layer_idx = layer_idx
        self.rt = runtime
        self.has_indexer = getattr(attn, "indexer", None) is not None

    def _begin(self, hidden: torch.Tensor, position_ids, past_key_values, cache, heads: slice):
        """``hidden [B, S, hidden]`` -> ``(cache, layer, past, pos [B, S], q_lat, q_pe, q_resid, c_new, pe_new)``:
        the model's cache object and this layer's entry, its length before the call, the positions, this call's
        query for ``heads`` and its tokens' latent and roped ``k_pe``."""
        cache = cache if past_key_values is None else past_key_values  # transformers 5.25 names it ``cache``
        if cache is None or not hasattr(cache, "layers"):
            name = type(self).__name__
            raise TypeError(f"{name} needs its model wrapper's cache: pass past_key_values=wrapper.new_cache(batch)")
        B, S, _ = hidden.shape
        layer = cache.layers[self.layer_idx]
        past = layer.length
        pos = self.rt.positions(position_ids, B, S, past)
        q_lat, q_pe, q_resid = query_heads(self.attn, hidden, heads)
        c_new, pe_new = latents(self.attn, hidden, self.rt.cos_sin[pos], self.rt.mla_style)
        return cache, layer, past, pos, q_lat, q_pe, q_resid, c_new, pe_new

    def _scorer(self, layer, qi, ki, wi, B, S, past):
        """A function ``(b, s, qcol, ok) -> [T, n]`` fp32: the rows' scores of the tokens the layer's cache holds
        (a DCP rank: its owned tokens, in local rows; the reference: all), ``-inf`` where not allowed, after
        storing this call's index keys (the cache keeps the owned ones)."""
        rt = self.rt
        if rt.options.indexer == "exact":
            keys = layer.update_index(ki)  # [B, n (local), D]

            def scores(b, s, qcol, ok):
                return exact_scores(qi[b, s], wi[b, s], keys[b]).masked_fill(~ok, float("-inf"))

            return scores
        from ...topk import indexer_logits

        cache = rt.index_cache(self.layer_idx)
        q8, wf, k8, ks = fp8_inputs(qi.reshape(B * S, *qi.shape[2:]), ki.reshape(B * S, -1), wi.reshape(B * S, -1))
        bb = torch.arange(B, device=ki.device).repeat_interleave(S)
        ss = torch.arange(S, device=ki.device).repeat(B)
        cache.write(bb * rt.stride + past + ss, k8, ks)  # an owner-sharded cache keeps the owned slots
        q8, wf = q8.view(B, S, *q8.shape[1:]), wf.view(B, S, -1)

        def scores(b, s, qcol, ok):
            bt = cache.block_table(b * rt.stride, rt.stride // cache.page_size // rt.W)
            x = indexer_logits(
                q8[b, s].contiguous(),
                wf[b, s].contiguous(),
                cache,
                qcol + 1,
                block_table=bt,
                max_seq_len=int(qcol.max()) + 1,
            )
            n = ok.shape[1]
            x = x[:, :n] if x.shape[1] >= n else torch.nn.functional.pad(x, (0, n - x.shape[1]), value=float("-inf"))
            return x.masked_fill(~ok, float("-inf"))

        return scores


def mla_rope_style(config) -> str:
    """``"interleaved"`` (DeepSeek-V3.2, GLM-5, DeepSeek-V3 with ``rope_interleave``) or ``"neox"``."""
    return "interleaved" if getattr(config, "rope_interleave", True) else "neox"


def index_rope_style(config) -> str:
    """The DSA indexer's RoPE: NeoX (half split) for DeepSeek-V3.2, interleaved for GLM-5."""
    return "interleaved" if config.model_type == "glm_moe_dsa" else "neox"


def query_heads(
    attn: torch.nn.Module, hidden: torch.Tensor, heads: slice
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``hidden [B, S, hidden]`` -> ``q_lat [B, S, h, kv_lora]`` bf16 (absorbed), ``q_pe [B, S, h, rope]`` bf16 (not
    rotated) for the heads ``heads`` only (their rows of ``q_b_proj`` / ``q_proj``), and ``q_resid [B, S, q_lora]``
    (the indexer's input; None without a query LoRA)."""
    B, S, _ = hidden.shape
    nope, D = attn.qk_nope_head_dim, attn.qk_head_dim
    rows = slice(heads.start * D, heads.stop * D)
    if attn.q_lora_rank is None:
        q_resid = None
        q = F.linear(hidden, attn.q_proj.weight[rows])
    else:
        q_resid = attn.q_a_layernorm(attn.q_a_proj(hidden))
        q = F.linear(q_resid, attn.q_b_proj.weight[rows])
    q = q.view(B, S, heads.stop - heads.start, D)
    w_uk = attn.kv_b_proj.weight.view(attn.num_heads, nope + attn.v_head_dim, -1)[heads, :nope]
    q_lat = torch.einsum("bshn,hnc->bshc", q[..., :nope].float(), w_uk.float()).to(torch.bfloat16)
    return q_lat, q[..., nope:].to(torch.bfloat16), q_resid


def latents(
    attn: torch.nn.Module, hidden: torch.Tensor, cos_sin_rows: torch.Tensor, rope_style: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """``c_kv [B, S, kv_lora]`` (after ``kv_a_layernorm``) and roped ``k_pe [B, S, rope]``, both in the model's
    dtype; ``cos_sin_rows [B, S, rope]`` are the rotary table's rows at the tokens' positions (fp32)."""
    compressed = attn.kv_a_proj_with_mqa(hidden)
    kv_pass, k_rot = torch.split(compressed, [attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
    c_kv = attn.kv_a_layernorm(kv_pass)
    k_pe = apply_rope(k_rot, cos_sin_rows, rope_style).to(compressed.dtype)
    return c_kv, k_pe


def value_heads(attn: torch.nn.Module, out_lat: torch.Tensor, heads: slice, dtype: torch.dtype) -> torch.Tensor:
    """``out_lat [T, h, kv_lora]`` (the attention-weighted latents of heads ``heads``) -> ``[T, h, v]`` in
    ``dtype``: ``W_UV`` applied in fp32."""
    nope = attn.qk_nope_head_dim
    w_uv = attn.kv_b_proj.weight.view(attn.num_heads, nope + attn.v_head_dim, -1)[heads, nope:]
    return torch.einsum("thc,hvc->thv", out_lat.float(), w_uv.float()).to(dtype)


def allowed(
    attention_mask: torch.Tensor | None, b: torch.Tensor, s: torch.Tensor, qcol: torch.Tensor, cols: torch.Tensor
) -> torch.Tensor:
    """``[T, n]`` bool: may query row ``(b[t], s[t])`` (global column ``qcol[t]``) attend global column ``cols[..]``?

    ``attention_mask`` is transformers' 4-D mask ``[B, 1, S, kv_len]`` (bool, True = attend; or additive float,
    0 = attend) or None (causal, no padding). ``cols`` is ``[n]`` (shared by every row) or ``[T, n]``; entries
    past the mask's width or negative are not allowed.
    """
    cols2 = cols.expand(qcol.shape[0], -1) if cols.dim() == 1 else cols
    ok = (cols2 >= 0) & (cols2 <= qcol[:, None])
    if attention_mask is None:
        return ok
    width = attention_mask.shape[-1]
    inside = ok & (cols2 < width)
    m = attention_mask[b, 0, s]  # [T, kv_len]
    m = torch.gather(m, 1, cols2.clamp(0, width - 1))
    if m.dtype != torch.bool:
        m = m > torch.finfo(m.dtype).min / 2
    return inside & m
