"""peerdcp: Decode Context Parallel exchanges over direct peer memory on one NVLink host.

Public names (DESIGN.md section 6)::

    peerdcp.probe(group=None) -> Capabilities
    peerdcp.memory.allocate(nbytes, group=None, *, memory="auto", device=None) -> PeerBuffer
    peerdcp.OutputReducer, peerdcp.QueryGather, peerdcp.IndexKCache, peerdcp.TopK
    peerdcp.PeerTimeoutError

Mechanism classes are imported lazily so that ``import peerdcp`` stays cheap and works without CUDA.
"""

from __future__ import annotations

from typing import Any

from . import memory
from .errors import PeerDCPError, PeerSetupError, PeerTimeoutError
from .memory import probe

__version__ = "0.1.0"

__all__ = [
    "probe",
    "memory",
    "PeerDCPError",
    "PeerSetupError",
    "PeerTimeoutError",
    "OutputReducer",
    "QueryGather",
    "IndexKCache",
    "TopK",
    "topk",
    "__version__",
]

_LAZY = {
    "OutputReducer": ("peerdcp.output", "OutputReducer"),
    "QueryGather": ("peerdcp.query", "QueryGather"),
    "IndexKCache": ("peerdcp.topk", "IndexKCache"),
    "TopK": ("peerdcp.topk", "TopK"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    if name in ("topk", "output", "query", "integrations"):
        import importlib

        return importlib.import_module(f"peerdcp.{name}")
    raise AttributeError(f"module 'peerdcp' has no attribute {name!r}")
