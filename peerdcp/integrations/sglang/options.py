"""The plugin's flags, how their values travel to SGLang's worker processes, and their validation.

SGLang builds its ``ServerArgs`` record from the argparse namespace and silently drops attributes that are
not record fields, and it starts every scheduler / TP worker with ``multiprocessing`` *spawn*: the workers
receive the record, not the namespace, and re-run ``load_plugins()``. The plugin therefore captures its
flags in a hook on ``ServerArgs.from_cli_args`` (and again in the resolution step, for the Python
``Engine`` path) and exports them as environment variables, which spawned children inherit; every process
reads them back with :func:`current`.

Environment variables (the first five are what the flags set; a user of SGLang's Python ``Engine`` API,
which has no argparse step, sets them directly):

============================================ ==================================================================
``PEERDCP_SGLANG_DCP_COMM_BACKEND``          SGLang's ``--dcp-comm-backend`` value (``vmm``/``symm_a2a`` route)
``PEERDCP_SGLANG_DCP_QUERY_BACKEND``         ``allgather`` (default) or ``vmm_direct``
``PEERDCP_SGLANG_DCP_INDEXER_BACKEND``       ``replicated`` (default) or ``owner_sharded``
``PEERDCP_SGLANG_DCP_TOPK_BACKEND``          ``allgather`` (default) or ``vmm``
``PEERDCP_SGLANG_DCP_PEER_FALLBACK``         ``error`` (default) or ``a2a``
``PEERDCP_SGLANG_TIMEOUT_S``                 bounded-wait timeout of the peerdcp objects (default 10)
``PEERDCP_SGLANG_MAX_TOKENS``                inbox rows when SGLang captures no decode graph (default 512)
``PEERDCP_SGLANG_ASSUME_CUDA``               **tests only**: ``1``/``0`` replaces the CUDA check of validation
``PEERDCP_SGLANG_MEMORY``                    **tests only**: force the memory kind of every route (``host`` on CPU)
============================================ ==================================================================
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

__all__ = [
    "COMM_CHOICES",
    "PEER_COMM",
    "QUERY_CHOICES",
    "INDEXER_CHOICES",
    "TOPK_CHOICES",
    "FALLBACK_CHOICES",
    "REQUIRED_INDEX_TOPK",
    "ENV",
    "Options",
    "current",
    "reset",
    "add_flags",
    "widen_comm_choices",
    "problems",
    "raise_problems",
    "cuda_available",
    "index_topk_from_model_path",
    "UNKNOWN",
]

# New values of SGLang's own --dcp-comm-backend: producer-direct Output/LSE exchange over VMM or over torch
# symmetric memory (both through peerdcp.OutputReducer, backend "direct").
PEER_COMM = ("vmm", "symm_a2a")
COMM_CHOICES = PEER_COMM
QUERY_CHOICES = ("allgather", "vmm_direct")
INDEXER_CHOICES = ("replicated", "owner_sharded")
TOPK_CHOICES = ("allgather", "vmm")
FALLBACK_CHOICES = ("error", "a2a")
REQUIRED_INDEX_TOPK = 2048

ENV = {
    "comm_backend": "PEERDCP_SGLANG_DCP_COMM_BACKEND",
    "query_backend": "PEERDCP_SGLANG_DCP_QUERY_BACKEND",
    "indexer_backend": "PEERDCP_SGLANG_DCP_INDEXER_BACKEND",
    "topk_backend": "PEERDCP_SGLANG_DCP_TOPK_BACKEND",
    "peer_fallback": "PEERDCP_SGLANG_DCP_PEER_FALLBACK",
}
ENV_TIMEOUT = "PEERDCP_SGLANG_TIMEOUT_S"
ENV_MAX_TOKENS = "PEERDCP_SGLANG_MAX_TOKENS"
ENV_ASSUME_CUDA = "PEERDCP_SGLANG_ASSUME_CUDA"
ENV_MEMORY = "PEERDCP_SGLANG_MEMORY"

# argparse destinations of the new flags (SGLang's own flag keeps its dest "dcp_comm_backend").
_DEST = {
    "query_backend": "dcp_query_backend",
    "indexer_backend": "dcp_indexer_backend",
    "topk_backend": "dcp_topk_backend",
    "peer_fallback": "dcp_peer_fallback",
}
_FLAG = {
    "comm_backend": "--dcp-comm-backend",
    "query_backend": "--dcp-query-backend",
    "indexer_backend": "--dcp-indexer-backend",
    "topk_backend": "--dcp-topk-backend",
    "peer_fallback": "--dcp-peer-fallback",
}
_CHOICES = {
    "query_backend": QUERY_CHOICES,
    "indexer_backend": INDEXER_CHOICES,
    "topk_backend": TOPK_CHOICES,
    "peer_fallback": FALLBACK_CHOICES,
}


class _Unknown:
    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN: Any = _Unknown()  # "not known at this point" (e.g. the model's index_topk before the config is read)


@dataclass(frozen=True)
class Options:
    """The plugin's view of the DCP flags.

    Attributes:
        comm_backend: SGLang's ``--dcp-comm-backend`` (None = unset; ``vmm``/``symm_a2a`` are peerdcp's).
        query_backend: ``allgather`` | ``vmm_direct``.
        indexer_backend: ``replicated`` | ``owner_sharded``.
        topk_backend: ``allgather`` | ``vmm``.
        peer_fallback: ``error`` (peer routes that cannot start fail start-up) | ``a2a`` (warn, use SGLang's
            collectives instead).
    """

    comm_backend: str | None = None
    query_backend: str = "allgather"
    indexer_backend: str = "replicated"
    topk_backend: str = "allgather"
    peer_fallback: str = "error"

    def __post_init__(self) -> None:
        for name, choices in _CHOICES.items():
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"peerdcp: {_FLAG[name]} must be one of {list(choices)}, got {value!r}")

    # --- which routes are peer routes ------------------------------------------------------------------
    @property
    def comm_is_peer(self) -> bool:
        return self.comm_backend in PEER_COMM

    def peer_routes(self) -> list[str]:
        """The selected peer routes as ``"--flag value"`` strings (empty when everything is SGLang's own)."""
        routes = []
        if self.comm_is_peer:
            routes.append(f"--dcp-comm-backend {self.comm_backend}")
        if self.query_backend != "allgather":
            routes.append(f"--dcp-query-backend {self.query_backend}")
        if self.indexer_backend != "replicated":
            routes.append(f"--dcp-indexer-backend {self.indexer_backend}")
        if self.topk_backend != "allgather":
            routes.append(f"--dcp-topk-backend {self.topk_backend}")
        return routes

    # --- transport ---------------------------------------------------------------------------------------
    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Options:
        env = os.environ if env is None else env
        kw: dict[str, Any] = {}
        for f in fields(cls):
            value = env.get(ENV[f.name])
            if value:
                kw[f.name] = value
        return cls(**kw)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace, base: Options | None = None) -> Options:
        """Values from a parsed SGLang namespace; attributes it lacks keep ``base`` (default: env)."""
        base = cls.from_env() if base is None else base
        kw: dict[str, Any] = {"comm_backend": getattr(ns, "dcp_comm_backend", base.comm_backend)}
        for name, dest in _DEST.items():
            kw[name] = getattr(ns, dest, getattr(base, name))
        return cls(**kw)

    def export_env(self, env: dict[str, str] | None = None) -> None:
        """Write the values where spawned SGLang workers find them (``os.environ`` by default)."""
        env = os.environ if env is None else env
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                env.pop(ENV[f.name], None)
            else:
                env[ENV[f.name]] = str(value)
        reset()


_CURRENT: Options | None = None


def current() -> Options:
    """The options of this process (read from the environment once; :func:`reset` forgets them)."""
    global _CURRENT
    if _CURRENT is None:
        _CURRENT = Options.from_env()
    return _CURRENT


def reset() -> None:
    global _CURRENT
    _CURRENT = None


def timeout_s() -> float:
    return float(os.environ.get(ENV_TIMEOUT, "10"))


def default_max_tokens() -> int:
    return int(os.environ.get(ENV_MAX_TOKENS, "512"))


def env_problems(env: Mapping[str, str] | None = None) -> list[str]:
    """What is wrong with the ``PEERDCP_SGLANG_TIMEOUT_S`` / ``PEERDCP_SGLANG_MAX_TOKENS`` values (unset: fine)."""
    from ..._runtime.checks import timeout_problem

    env = os.environ if env is None else env
    out = []
    raw = env.get(ENV_TIMEOUT)
    if raw:
        try:
            bad = timeout_problem(float(raw))
        except ValueError:
            bad = f"not a number: {raw!r}"
        if bad:
            out.append(f"{ENV_TIMEOUT}: {bad}")
    raw = env.get(ENV_MAX_TOKENS)
    if raw:
        try:
            ok = int(raw) >= 1
        except ValueError:
            ok = False
        if not ok:
            out.append(f"{ENV_MAX_TOKENS} must be a positive integer, got {raw!r}")
    return out


def memory_override() -> str | None:
    return os.environ.get(ENV_MEMORY) or None


# --- the parser --------------------------------------------------------------------------------------------
_HELP = {
    "query_backend": "Decode-context-parallel query exchange: 'allgather' (SGLang's NCCL all-gather) or "
    "'vmm_direct' (peerdcp.QueryGather: each rank loads its peers' query heads over NVLink peer memory). "
    "Needs CUDA, --dcp-size > 1, one host with P2P; conflicts with --dcp-replicate-q-proj.",
    "indexer_backend": "DSA indexer K cache under DCP: 'replicated' (SGLang's) or 'owner_sharded' (each rank "
    "keeps only the tokens it owns; peerdcp.IndexKCache). Not routed in SGLang 0.5.23: see docs/sglang.md.",
    "topk_backend": "DSA top-k under DCP: 'allgather' or 'vmm' (exact global top-k merged from the owners' "
    "candidates over peer memory; peerdcp.TopK). Needs --dcp-indexer-backend owner_sharded and index_topk "
    "2048. Not routed in SGLang 0.5.23: see docs/sglang.md.",
    "peer_fallback": "What a peer route does when the DCP group cannot use peer memory (several hosts, no "
    "P2P): 'error' (default: start-up fails naming the reason from peerdcp.probe) or 'a2a' (warn and use "
    "SGLang's NCCL collectives).",
}
_COMM_HELP = (
    " peerdcp adds 'vmm' (producer-direct Output/LSE stores into the owner's inbox, CUDA VMM peer memory) and "
    "'symm_a2a' (the same over torch symmetric memory); both need CUDA, --dcp-size > 1 and one host with P2P; "
    "'symm_a2a' does not support two-batch overlap."
)


def widen_comm_choices(parser: argparse.ArgumentParser) -> bool:
    """Add ``vmm`` and ``symm_a2a`` to the choices of SGLang's ``--dcp-comm-backend`` action.

    Returns False when the parser has no such option (the caller reports it as a missing target).
    A fresh list is assigned (SGLang's field metadata shares its list by reference; it is not mutated).
    """
    action = parser._option_string_actions.get("--dcp-comm-backend")
    if action is None:
        return False
    choices = list(action.choices or [])
    added = [c for c in COMM_CHOICES if c not in choices]
    if added:
        action.choices = choices + added
        action.help = (action.help or "") + _COMM_HELP
    return True


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--dcp-query-backend``, ``--dcp-indexer-backend``, ``--dcp-topk-backend`` and
    ``--dcp-peer-fallback`` (idempotent: a parser that already has them is left alone)."""
    if "--dcp-query-backend" in parser._option_string_actions:
        return
    group = parser.add_argument_group("peerdcp (decode context parallel over peer memory)")
    for name, dest in _DEST.items():
        group.add_argument(
            _FLAG[name],
            dest=dest,
            type=str,
            choices=list(_CHOICES[name]),
            default=getattr(Options(), name),
            help=_HELP[name],
        )


# --- validation --------------------------------------------------------------------------------------------
def cuda_available(device: str | None = None) -> tuple[bool, str]:
    """(ok, why) for "the peer routes can run on CUDA here". ``PEERDCP_SGLANG_ASSUME_CUDA`` (tests only)
    replaces the check with its value."""
    forced = os.environ.get(ENV_ASSUME_CUDA)
    if forced in ("0", "1"):
        return forced == "1", f"{ENV_ASSUME_CUDA}={forced}"
    if device is not None and str(device).split(":", 1)[0] != "cuda":
        return False, f"--device {device}"
    import torch

    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    return True, "CUDA available"


def index_topk_from_model_path(model_path: str | None, json_override: str | None = None) -> Any:
    """The model's ``index_topk`` read from a local ``config.json`` (None when the model has none), or
    :data:`UNKNOWN` when the config cannot be read without downloading it (checked again at resolution)."""
    cfg: dict | None = None
    if model_path and os.path.isfile(os.path.join(model_path, "config.json")):
        try:
            with open(os.path.join(model_path, "config.json")) as f:
                cfg = json.load(f)
        except (OSError, ValueError):
            cfg = None
    if cfg is None:
        return UNKNOWN
    if json_override:
        try:
            cfg.update(json.loads(json_override))
        except ValueError:
            pass
    return index_topk_of(cfg)


def index_topk_of(hf_config: Any) -> Any:
    """``index_topk`` of an HF config (dict or object; looks into ``text_config`` too), None if absent."""

    def get(obj: Any, key: str) -> Any:
        return obj.get(key) if isinstance(obj, dict) else getattr(obj, key, None)

    value = get(hf_config, "index_topk")
    if value is None:
        text = get(hf_config, "text_config")
        if text is not None:
            value = get(text, "index_topk")
    return value


def problems(
    opts: Options,
    *,
    dcp_size: int,
    cuda: tuple[bool, str],
    replicate_q_proj: bool | None,
    two_batch_overlap: bool,
    index_topk: Any = UNKNOWN,
) -> list[str]:
    """Every reason the combination cannot run (empty list = valid). Knows nothing of the hardware beyond
    ``cuda``; one-host / P2P eligibility is checked at start-up, when the DCP group exists."""
    out: list[str] = []
    routes = opts.peer_routes()
    if routes and dcp_size <= 1:
        out.append(f"{', '.join(routes)} need(s) --dcp-size > 1 (got --dcp-size {dcp_size})")
    if routes and not cuda[0]:
        out.append(f"{', '.join(routes)} need(s) CUDA ({cuda[1]})")
    if opts.topk_backend == "vmm" and opts.indexer_backend != "owner_sharded":
        out.append(
            "--dcp-topk-backend vmm needs --dcp-indexer-backend owner_sharded (it merges the owners' local "
            f"candidates), got --dcp-indexer-backend {opts.indexer_backend}"
        )
    dsa_routes = [r for r in routes if r.startswith(("--dcp-indexer-backend", "--dcp-topk-backend"))]
    if dsa_routes and index_topk is not UNKNOWN:
        if index_topk is None:
            out.append(f"{', '.join(dsa_routes)} need(s) a DSA model (index_topk in its config); this model has none")
        elif opts.topk_backend == "vmm" and int(index_topk) != REQUIRED_INDEX_TOPK:
            out.append(f"--dcp-topk-backend vmm needs index_topk {REQUIRED_INDEX_TOPK}, the model has {index_topk}")
    if opts.query_backend == "vmm_direct" and replicate_q_proj:
        out.append(
            "--dcp-query-backend vmm_direct conflicts with --dcp-replicate-q-proj (replicated Q has no query "
            "exchange to replace); pass --no-dcp-replicate-q-proj or --dcp-query-backend allgather"
        )
    if routes:  # the plugin's environment knobs, read in every worker: wrong values fail here, not there
        out += env_problems()
    if opts.comm_backend == "symm_a2a" and two_batch_overlap:
        out.append(
            "--dcp-comm-backend symm_a2a does not support --enable-two-batch-overlap (one symmetric workspace "
            "per DCP group); use --dcp-comm-backend vmm or a2a"
        )
    return out


def raise_problems(found: list[str]) -> None:
    """One ValueError listing every problem (SGLang's CLI prints it and exits)."""
    if found:
        lines = "\n".join(f"  - {p}" for p in found)
        raise ValueError(f"peerdcp SGLang plugin: invalid DCP configuration:\n{lines}")
