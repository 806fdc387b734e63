"""Which transformers versions and model families ``peerdcp.integrations.transformers`` supports.

The DCP attention replaces the attention module of every decoder layer and reads that module's weights by
name (``q_a_proj``, ``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``, ``indexer.wq_b`` ...);
those names and the layer call signature are what a version must keep. 5.17 is the oldest release with all
three families (and the GPU machine's); 5.25 the newest checked.
"""

from __future__ import annotations

import re

__all__ = ["MIN_VERSION", "MAX_VERSION", "SPEC", "FAMILIES", "check_transformers", "family_of"]

MIN_VERSION = (5, 17)
MAX_VERSION = (5, 25)  # newest minor release checked; the extra pins < 5.26
SPEC = "transformers>=5.17,<5.26"

# model_type -> (what it is, DSA indexer present)
FAMILIES: dict[str, tuple[str, bool]] = {
    "deepseek_v32": ("DeepSeek-V3.2 (MLA + DSA indexer, NeoX indexer RoPE)", True),
    "glm_moe_dsa": ("GLM-5 (MLA + DSA indexer, interleaved indexer RoPE, shared top-k layers)", True),
    "deepseek_v3": ("DeepSeek-V3 (dense MLA)", False),
}


def _parse(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    if not m:
        raise RuntimeError(f"cannot read the transformers version {version!r}")
    return int(m.group(1)), int(m.group(2))


def check_transformers(version: str | None = None) -> str:
    """Raise ``ImportError`` naming what is installed and what is supported unless transformers is importable
    at a supported version; return the version string. ``version`` overrides the installed one (tests)."""
    if version is None:
        try:
            import transformers
        except ImportError as e:
            raise ImportError(
                f"peerdcp.integrations.transformers needs {SPEC} (pip install 'peerdcp[transformers]'); "
                f"transformers is not installed ({e})"
            ) from None
        version = transformers.__version__
    if not MIN_VERSION <= _parse(version) <= MAX_VERSION:
        raise ImportError(
            f"peerdcp.integrations.transformers supports {SPEC}; transformers {version} is installed "
            "(pip install 'peerdcp[transformers]')"
        )
    return version


def family_of(model_or_config: object) -> str:
    """The supported family (``config.model_type``) of a transformers model or config; ``ValueError`` naming
    the model type and the supported ones otherwise."""
    config = getattr(model_or_config, "config", model_or_config)
    mt = getattr(config, "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(
            f"peerdcp.integrations.transformers: model_type {mt!r} is not supported; supported: "
            + ", ".join(f"{k} ({v[0]})" for k, v in FAMILIES.items())
        )
    return mt
