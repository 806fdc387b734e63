"""Hugging Face transformers DSA/MLA models (``deepseek_v32``, ``glm_moe_dsa``, ``deepseek_v3``) under peerdcp.

Supported versions and families: :mod:`.versions` (``check_transformers``, ``family_of``); tiny random
configs for tests and ``peerdcp generate``: :mod:`.configs`. The DCP model: :func:`shard_model` /
:class:`DCPOptions` (:mod:`.model`, :mod:`.attention`), checked against :func:`reference_model`
(:mod:`.reference`). Importing this package does not import transformers; :func:`check_transformers` does, and
says what is installed and what is supported (the model names are loaded on first use).
"""

from __future__ import annotations

from .configs import FAMILY_NAMES, tiny_config
from .versions import FAMILIES, MAX_VERSION, MIN_VERSION, SPEC, check_transformers, family_of

_LAZY = ("DCPOptions", "DCPModel", "ReferenceModel", "shard_model", "reference_model")

__all__ = [
    *_LAZY,
    "FAMILIES",
    "FAMILY_NAMES",
    "MIN_VERSION",
    "MAX_VERSION",
    "SPEC",
    "check_transformers",
    "family_of",
    "tiny_config",
]


def __getattr__(name: str):
    if name in _LAZY:
        from . import model

        return getattr(model, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
