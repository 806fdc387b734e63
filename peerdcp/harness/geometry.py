"""Named layer geometries for ``peerdcp run`` and the benchmarks (DESIGN.md section 8).

Numbers from `notes/dsa-query-topk.md` section 1: MLA absorbed query 512 + 64, softmax scale, RoPE
(YaRN or plain), DSA indexer heads x dim and top-k. ``scaled_for_cpu`` shrinks a geometry so the
interpreter finishes the main job in about a minute, keeping its structure (DSA or dense, RoPE style).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

__all__ = ["Geometry", "GEOMETRIES", "get_geometry"]


@dataclass(frozen=True)
class Geometry:
    name: str
    heads: int  # attention heads of the whole model layer (all ranks)
    nope_dim: int = 512  # kv_lora_rank: absorbed q_nope width = latent KV width
    rope_dim: int = 64
    softmax_scale: float = 192**-0.5
    rope: str = "deepseek-v3.2"  # a preset name of peerdcp.query.rope, or "plain:<theta>"
    max_positions: int = 163840
    index_heads: int = 0  # 0: dense MLA (no indexer)
    index_dim: int = 128
    index_rope_style: str = "neox"
    topk: int = 2048
    hidden: int = 1024  # width of the random activations the projections read (not the model's)

    @property
    def dsa(self) -> bool:
        return self.index_heads > 0

    def scaled_for_cpu(self) -> Geometry:
        return replace(
            self,
            heads=8,
            nope_dim=64,
            rope_dim=16,
            index_heads=min(self.index_heads, 4),
            index_dim=32 if self.index_heads else self.index_dim,
            topk=32,
            hidden=64,
            max_positions=4096,
            rope=self.rope if not self.rope.startswith("plain") else self.rope,
        )


def _yarn_mscale(factor: float) -> float:
    return 0.1 * math.log(factor) + 1.0


GEOMETRIES: dict[str, Geometry] = {
    "deepseek-v3.2": Geometry(
        "deepseek-v3.2",
        heads=128,
        softmax_scale=192**-0.5 * _yarn_mscale(40) ** 2,
        rope="deepseek-v3.2",
        max_positions=163840,
        index_heads=64,
        index_rope_style="neox",
    ),
    "glm-5": Geometry(
        "glm-5",
        heads=64,
        softmax_scale=256**-0.5,
        rope="plain:1000000",
        max_positions=202752,
        index_heads=32,
        index_rope_style="interleaved",
    ),
    "kimi-k2.5": Geometry(
        "kimi-k2.5",
        heads=64,
        softmax_scale=192**-0.5 * _yarn_mscale(64) ** 2,
        rope="kimi-k2",
        max_positions=262144,
        index_heads=0,
    ),
}


def get_geometry(name: str) -> Geometry:
    try:
        return GEOMETRIES[name]
    except KeyError:
        raise ValueError(f"unknown geometry {name!r}; choose one of {sorted(GEOMETRIES)}") from None
