"""The model's own rotary table in peerdcp's layout (DESIGN.md section 3: rows ``[cos | sin]``, fp32).

transformers' rotary embedding returns ``cos, sin [B, P, rope]`` as ``cat(freqs, freqs)`` (its YaRN / default
frequencies and ``attention_scaling`` applied); peerdcp's kernels take one row per position with the first half
of each. The table is computed in fp32 (the input's dtype sets the output's).
"""

from __future__ import annotations

import torch

__all__ = ["rope_table"]


def rope_table(model: torch.nn.Module, max_positions: int, device: torch.device | str | None = None) -> torch.Tensor:
    """``[max_positions, rope]`` fp32 rows ``[cos_0..cos_{d/2-1} | sin_0..sin_{d/2-1}]`` from
    ``model.model.rotary_emb`` (a transformers causal LM of a supported family)."""
    if not isinstance(max_positions, int) or max_positions < 1:
        raise ValueError(f"rope_table: max_positions must be a positive int, got {max_positions!r}")
    rot = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rot is None:
        raise TypeError(f"rope_table: {type(model).__name__} has no model.rotary_emb")
    dev = torch.device(device) if device is not None else rot.inv_freq.device
    pos = torch.arange(max_positions, device=dev)[None]
    cos, sin = rot(torch.zeros(1, dtype=torch.float32, device=dev), position_ids=pos)
    d = cos.shape[-1]
    return torch.cat([cos[0, :, : d // 2], sin[0, :, : d // 2]], dim=-1).float().contiguous()
