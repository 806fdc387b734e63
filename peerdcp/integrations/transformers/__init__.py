"""Hugging Face transformers DSA/MLA models (``deepseek_v32``, ``glm_moe_dsa``, ``deepseek_v3``) under peerdcp.

Supported versions and families: :mod:`.versions` (``check_transformers``, ``family_of``); tiny random
configs for tests and ``peerdcp generate``: :mod:`.configs`. Importing this package does not import
transformers; :func:`check_transformers` does, and says what is installed and what is supported.
"""

from __future__ import annotations

from .configs import FAMILY_NAMES, tiny_config
from .versions import FAMILIES, MAX_VERSION, MIN_VERSION, SPEC, check_transformers, family_of

__all__ = [
    "FAMILIES",
    "FAMILY_NAMES",
    "MIN_VERSION",
    "MAX_VERSION",
    "SPEC",
    "check_transformers",
    "family_of",
    "tiny_config",
]
