"""Tiny random configs of the supported families (no weights are downloaded; none are needed).

Structure kept from the real models: MLA with a latent ``c_kv`` + a shared roped ``k_pe``, the DSA indexer
(DeepSeek-V3.2 and GLM-5), a dense first layer then MoE, GLM-5's shared top-k layer (pattern ``"FS"``).
Dims are small powers of two so the CPU interpreter finishes in seconds; 6 heads split over W = 2 and 3;
an index head dim of 32 is the smallest ``IndexKCache`` takes.
"""

from __future__ import annotations

from typing import Any

from .versions import family_of

__all__ = ["FAMILY_NAMES", "SIZES", "tiny_config", "attention_config"]

# CLI names -> model_type
FAMILY_NAMES = {"deepseek-v3.2": "deepseek_v32", "glm-5": "glm_moe_dsa", "deepseek-v3": "deepseek_v3"}


def tiny_config(family: str, *, layers: int = 2, heads: int = 6, topk: int = 8, **overrides: Any):
    """A transformers config of ``family`` (CLI name or model_type) at a CPU-sized geometry.

    Args:
        family: ``deepseek-v3.2`` | ``glm-5`` | ``deepseek-v3`` (or the model_type).
        layers: decoder layers (the first dense, the rest MoE).
        heads: attention heads (a multiple of the world size that will run it).
        topk: the indexer's top-k (DSA families), small so short prompts cross it.
        overrides: any further config field.
    """
    import transformers

    mt = FAMILY_NAMES.get(family, family)
    if not isinstance(heads, int) or heads < 1:
        raise ValueError(f"tiny_config: heads must be a positive int, got {heads!r}")
    kw: dict[str, Any] = dict(
        vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=heads, n_shared_experts=1, n_routed_experts=4,
        num_experts_per_tok=2, n_group=1, topk_group=1, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=16,
        qk_nope_head_dim=16, v_head_dim=16, first_k_dense_replace=1, max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )  # fmt: skip
    if mt == "deepseek_v32":
        cls = transformers.DeepseekV32Config
        kw.update(index_topk=topk, index_head_dim=32, index_n_heads=4)
    elif mt == "glm_moe_dsa":
        cls = transformers.GlmMoeDsaConfig
        kw.update(index_topk=topk, index_head_dim=32, index_n_heads=4)
        kw["index_topk_pattern"] = "F" + "S" * (layers - 1) if layers > 1 else "F"
    elif mt == "deepseek_v3":
        cls = transformers.DeepseekV3Config
    else:
        family_of(type("C", (), {"model_type": mt})())  # raises the supported-family error
    kw.update(overrides)
    return cls(**kw)


def attention_config(family: str, *, layers: int = 2, **overrides: Any):
    """``family`` at the real models' attention geometry with a small MoE (for one GPU): 128 heads, MLA latent 512
    + rope 64 (nope 128, v 128, q LoRA 1536, hidden 7168), YaRN RoPE (factor 40 over 4096 positions) and, for the
    DSA families, the indexer of 64 heads x 128 with top-k 2048; 8 routed experts of width 256, vocabulary 4096."""
    kw: dict[str, Any] = dict(
        hidden_size=7168,
        intermediate_size=2048,
        moe_intermediate_size=256,
        n_routed_experts=8,
        num_experts_per_tok=2,
        kv_lora_rank=512,
        q_lora_rank=1536,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        vocab_size=4096,
        max_position_embeddings=163840,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 40.0,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
    )
    if FAMILY_NAMES.get(family, family) != "deepseek_v3":
        kw.update(index_head_dim=128, index_n_heads=64)
    kw.update(overrides)
    return tiny_config(family, layers=layers, heads=128, topk=2048, **kw)


# ``peerdcp generate --size``: the model geometry by name
SIZES = {"tiny": tiny_config, "attention": attention_config}
