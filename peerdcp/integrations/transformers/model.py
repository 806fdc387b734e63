"""Turn a transformers causal LM of a supported family into a DCP model, or into its unsharded reference.

    dcp = shard_model(model, group, DCPOptions(max_batch=2, max_len=64))   # every rank, collective
    out = model.generate(ids, attention_mask=mask, past_key_values=dcp.new_cache(2), max_new_tokens=16)
    dcp.close()

:func:`shard_model` replaces every decoder layer's ``self_attn`` with a :class:`~.attention.DCPAttention` (the
module's weights are reused, not copied) and creates the peerdcp objects it calls: one :class:`~peerdcp.QueryGather`,
one :class:`~peerdcp.OutputReducer`, one :class:`~peerdcp.TopK` shared by the layers (their calls follow one another)
and, with the FP8 indexer, one owner-sharded :class:`~peerdcp.IndexKCache` per indexer layer.
:func:`reference_model` installs :class:`~.reference.ReferenceAttention` instead (same options; its FP8 indexer
scores over a replicated ``IndexKCache``). Both change the model in place; deep-copy it first to keep both.
Everything else (embeddings, norms, MoE, ``lm_head``, ``generate``) stays transformers' code; the cache
(:class:`~.cache.ShardedLatentCache`) reports the global length, so position ids and masks stay transformers'.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.distributed as dist

from ..._runtime.groups import resolve_group
from .cache import ShardedLatentCache
from .checks import Faults, MechanismChecks
from .mla import index_rope_style, mla_rope_style
from .rope import rope_table
from .versions import FAMILIES, check_transformers, family_of

__all__ = ["DCPOptions", "DCPModel", "ReferenceModel", "shard_model", "reference_model", "BACKENDS"]

# CLI / options name -> each mechanism's own backend name
BACKENDS = {
    "query": {"auto": "auto", "direct": "direct", "collective": "allgather"},
    "topk": {"auto": "auto", "direct": "direct", "collective": "allgather"},
    "output": {"auto": "auto", "direct": "direct", "collective": "a2a"},
}


@dataclasses.dataclass
class DCPOptions:
    """How a model runs DCP.

    Attributes:
        max_batch: the most sequences one ``generate`` call carries.
        max_len: the longest sequence (prompt + new tokens): sizes the rotary table and the index-K caches.
        chunk: rows (tokens) per exchange call; a prompt longer than this runs in chunks (every call's T <= chunk).
        interleave: ownership interleave I: column g lives on rank ``(g // I) % W``.
        indexer: ``"fp8"`` (the real model's FP8 path: Hadamard, FP8 keys in an IndexKCache, ``indexer_logits``)
            or ``"exact"`` (the model's own fp32 formula over the owned keys).
        query_dtype: ``torch.bfloat16`` or ``torch.float8_e4m3fn`` (the gathered query).
        backends: per mechanism (``query``, ``topk``, ``output``): ``"auto" | "direct" | "collective"``.
        memory: peer memory for the direct backends: ``"auto" | "vmm" | "symm" | "host"`` (CPU: host).
        timeout_s: bound on every wait for a peer, in seconds.
        check: check every exchange on its own inputs (:mod:`.checks`; costs host all-gathers per call).
        record: keep every layer's top-k ids per call (:attr:`DCPModel.ids_log`).
        fault: test-only corruption (:data:`.checks.FAULTS`).
    """

    max_batch: int = 1
    max_len: int = 256
    chunk: int = 256
    interleave: int = 1
    indexer: str = "fp8"
    query_dtype: torch.dtype = torch.bfloat16
    backends: dict[str, str] = dataclasses.field(
        default_factory=lambda: {"query": "auto", "topk": "auto", "output": "auto"}
    )
    memory: str = "auto"
    timeout_s: float = 30.0
    check: bool = False
    record: bool = False
    fault: str = "none"

    def validate(self) -> None:
        for name in ("max_batch", "max_len", "chunk", "interleave"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"DCPOptions.{name} must be a positive int, got {v!r}")
        if self.indexer not in ("fp8", "exact"):
            raise ValueError(f"DCPOptions.indexer must be 'fp8' or 'exact', got {self.indexer!r}")
        if self.query_dtype not in (torch.bfloat16, torch.float8_e4m3fn):
            raise ValueError(f"DCPOptions.query_dtype must be bfloat16 or float8_e4m3fn, got {self.query_dtype}")
        for mech, table in BACKENDS.items():
            if self.backends.get(mech, "auto") not in table:
                raise ValueError(f"DCPOptions.backends[{mech!r}] must be one of {sorted(table)}")
        if set(self.backends) - set(BACKENDS):
            raise ValueError(f"DCPOptions.backends: unknown mechanisms {sorted(set(self.backends) - set(BACKENDS))}")


class _Runtime:
    """What the attention modules of one model share: the family's layout, the rotary table, the logs."""

    def __init__(self, model: torch.nn.Module, options: DCPOptions, W: int, rank: int) -> None:
        check_transformers()
        options.validate()
        self.family = family_of(model)
        cfg = model.config
        self.model, self.options, self.W, self.rank = model, options, W, rank
        self.dsa = FAMILIES[self.family][1]
        self.returns_topk = self.family == "glm_moe_dsa"
        self.topk = int(cfg.index_topk) if self.dsa else 0
        self.mla_style, self.index_style = mla_rope_style(cfg), index_rope_style(cfg)
        self.layers = list(model.model.layers)
        self.device = next(model.parameters()).device
        self.cos_sin = rope_table(model, options.max_len, self.device)
        self.chunk = options.chunk
        # sequences sit at slot b * stride of the index-K caches: a multiple of every cache's alignment
        self.stride = (
            -(-options.max_len // (W * math.lcm(options.interleave, 64))) * W * math.lcm(options.interleave, 64)
        )
        self.ids_log: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(self.layers))}

    def positions(self, position_ids: torch.Tensor | None, B: int, S: int, past: int) -> torch.Tensor:
        """``[B, S]`` int64 rows of the rotary table (transformers' position ids, or the columns without them)."""
        if position_ids is None:
            p = torch.arange(past, past + S, device=self.device)[None]
        else:
            p = position_ids.to(self.device, torch.int64)
        p = p.expand(B, S)
        if self.device.type == "cpu" and p.numel() and int(p.max()) >= self.options.max_len:
            raise ValueError(f"position {int(p.max())} is past DCPOptions.max_len = {self.options.max_len}")
        return p

    def log_ids(self, layer: int, ids: torch.Tensor) -> None:
        if self.options.record:
            self.ids_log[layer].append(ids.detach().cpu())

    def index_cache(self, layer: int):
        """The :class:`~peerdcp.topk.IndexKCache` of a layer with an indexer (the FP8 indexer)."""
        return self.index_caches[layer]

    def reset_logs(self) -> None:
        self.ids_log = {i: [] for i in self.ids_log}

    def _check_batch(self, batch: int) -> None:
        if not isinstance(batch, int) or not 1 <= batch <= self.options.max_batch:
            raise ValueError(f"batch must be an int in [1, max_batch = {self.options.max_batch}], got {batch!r}")


class DCPModel(_Runtime):
    """The peerdcp side of a sharded model (made by :func:`shard_model`; collective: every rank of the group).

    Attributes:
        H: this rank's heads; ``heads``: their slice of the model's heads.
        info: per mechanism ``{"backend", "memory", "reason"}``.
        checks: :class:`~.checks.MechanismChecks` (its ``stats``; ``where`` labels the calls).
        ids_log: per layer, the ``[B, S, topk]`` ids of each call (with ``options.record``).
    """

    def __init__(self, model: torch.nn.Module, group, options: DCPOptions) -> None:
        from ...output import OutputReducer
        from ...query import QueryGather
        from ...topk import IndexKCache, TopK

        info = resolve_group(group)
        super().__init__(model, options, info.world_size, info.rank)
        self.group, self.cpu_group = info.group, info.cpu_group
        cfg = model.config
        W = self.W
        if cfg.num_attention_heads % W:
            raise ValueError(f"{cfg.num_attention_heads} attention heads do not split over {W} ranks")
        self.H = cfg.num_attention_heads // W
        self.heads = slice(self.rank * self.H, (self.rank + 1) * self.H)
        self.faults = Faults(options.fault, self.rank, W)
        self.checks = MechanismChecks(
            self.cpu_group,
            self.rank,
            W,
            options.interleave,
            self.mla_style,
            options.query_dtype,
            self.cos_sin,
            self.topk,
            options.check,
        )
        mem = options.memory if self.device.type == "cuda" else "host"
        be = {m: BACKENDS[m][options.backends.get(m, "auto")] for m in BACKENDS}
        kv_lora, rope = cfg.kv_lora_rank, cfg.qk_rope_head_dim
        self._objects: list[Any] = []
        self.index_caches: dict[int, Any] = {}
        try:
            self.qg = QueryGather(
                group,
                max_tokens=options.chunk,
                heads_per_rank=self.H,
                nope_dim=kv_lora,
                rope_dim=rope,
                rope_style=self.mla_style,
                out_dtype=options.query_dtype,
                backend=be["query"],
                memory=mem,
                timeout_s=options.timeout_s,
                device=self.device,
            )
            self._objects.append(self.qg)
            self.red = OutputReducer(
                group,
                max_tokens=options.chunk,
                heads_per_rank=self.H,
                head_dim=kv_lora,
                dtype=torch.bfloat16,
                backend=be["output"],
                memory=mem,
                lse_base="e",
                timeout_s=options.timeout_s,
                device=self.device,
            )
            self._objects.append(self.red)
            self.info = {
                "query": {"backend": self.qg.backend, "memory": self.qg.memory, "reason": self.qg.reason},
                "output": {"backend": self.red.backend, "memory": self.red.memory, "reason": self.red.reason},
            }
            if self.dsa:
                self.tk = TopK(
                    group,
                    max_rows=options.chunk,
                    topk=self.topk,
                    backend=be["topk"],
                    memory=mem,
                    interleave=options.interleave,
                    timeout_s=options.timeout_s,
                    device=self.device,
                )
                self._objects.append(self.tk)
                self.info["topk"] = {"backend": self.tk.backend, "memory": self.tk.memory, "reason": self.tk.reason}
                if options.indexer == "fp8":
                    for i, layer in enumerate(self.layers):
                        if getattr(layer.self_attn, "indexer", None) is not None:
                            self.index_caches[i] = IndexKCache(
                                group,
                                capacity_tokens=options.max_batch * self.stride,
                                head_dim=cfg.index_head_dim,
                                layout="owner_sharded",
                                interleave=options.interleave,
                                device=self.device,
                            )
                            self._objects.append(self.index_caches[i])
                    c0 = next(iter(self.index_caches.values()), None)
                    self.info["indexer"] = {
                        "backend": "fp8 owner_sharded",
                        "memory": "device",
                        "reason": c0.reason if c0 else "no indexer layer",
                    }
                else:
                    self.info["indexer"] = {
                        "backend": "exact owner_sharded",
                        "memory": "device",
                        "reason": "the model's fp32 formula over the owned keys (torch)",
                    }
        except BaseException:
            self.close()
            raise
        from .attention import DCPAttention

        for i, layer in enumerate(self.layers):
            layer.self_attn = DCPAttention(layer.self_attn, i, self)

    def new_cache(self, batch: int) -> ShardedLatentCache:
        """An empty cache of this rank's columns for ``batch`` sequences (one per ``generate`` call)."""
        self._check_batch(batch)
        return ShardedLatentCache(len(self.layers), self.rank, self.W, self.options.interleave)

    def index_bytes_local(self) -> int:
        """Bytes of FP8 index keys this rank holds (the owner-sharded caches)."""
        return sum(int(c.nbytes) for c in self.index_caches.values())

    def close(self) -> None:
        """Collective and idempotent: releases the peer memory of every object."""
        for o in reversed(getattr(self, "_objects", [])):
            o.close()
        self._objects = []


class ReferenceModel(_Runtime):
    """The unsharded side (made by :func:`reference_model`): every head, every token on this process.

    ``pinned``: per layer, the ``[B, S, topk]`` ids to use for each call instead of the reference's own (a DCP
    model's ``ids_log``, for teacher forcing with the selection fixed); the reference still logs its own.
    """

    def __init__(self, model: torch.nn.Module, group, options: DCPOptions) -> None:
        from ...topk import IndexKCache

        info = resolve_group(group) if dist.is_available() and dist.is_initialized() else None
        super().__init__(model, options, 1, 0)
        self.pinned: dict[int, list[torch.Tensor]] | None = None
        self._calls: dict[int, int] = {}
        self.index_caches: dict[int, Any] = {}
        if self.dsa and options.indexer == "fp8":
            if info is None:
                raise ValueError("reference_model with the FP8 indexer needs an initialized process group")
            for i, layer in enumerate(self.layers):
                if getattr(layer.self_attn, "indexer", None) is not None:
                    # replicated over the group: every rank holds every key, so each scores alone
                    self.index_caches[i] = IndexKCache(
                        info.group,
                        capacity_tokens=options.max_batch * self.stride,
                        head_dim=model.config.index_head_dim,
                        layout="replicated",
                        device=self.device,
                    )
        from .reference import ReferenceAttention

        for i, layer in enumerate(self.layers):
            layer.self_attn = ReferenceAttention(layer.self_attn, i, self)

    def new_cache(self, batch: int) -> ShardedLatentCache:
        self._check_batch(batch)
        self._calls = {}
        return ShardedLatentCache(len(self.layers), 0, 1, 1)

    def pin(self, ids_log: dict[int, list[torch.Tensor]] | None) -> None:
        """Use these ids (per layer, per call, in call order) from the next :meth:`new_cache` on; None: own."""
        self.pinned = ids_log
        self._calls = {}

    def next_pinned(self, layer: int, B: int, S: int) -> torch.Tensor | None:
        if self.pinned is None:
            return None
        k = self._calls.get(layer, 0)
        self._calls[layer] = k + 1
        log = self.pinned.get(layer, [])
        if k >= len(log) or tuple(log[k].shape[:2]) != (B, S):
            raise ValueError(f"pinned ids of layer {layer} have no call {k} of shape [{B}, {S}, topk]")
        return log[k].to(self.device)

    def index_bytes_replicated(self) -> int:
        return sum(int(c.nbytes) for c in self.index_caches.values())

    def close(self) -> None:
        for c in self.index_caches.values():
            c.close()
        self.index_caches = {}


def shard_model(model: torch.nn.Module, group=None, options: DCPOptions | None = None) -> DCPModel:
    """Make ``model`` (a transformers causal LM of a supported family) run DCP over ``group`` (None: the default
    group); collective. Every rank holds the whole model; each computes its own heads and keeps its own tokens."""
    return DCPModel(model, group, options or DCPOptions())


def reference_model(model: torch.nn.Module, group=None, options: DCPOptions | None = None) -> ReferenceModel:
    """Make ``model`` compute the unsharded attention DCP is checked against (collective with the FP8 indexer)."""
    return ReferenceModel(model, group, options or DCPOptions())
