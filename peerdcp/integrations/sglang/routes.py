"""The routes: SGLang's DCP merge and query gather served by peerdcp objects, and their workspaces.

Layouts (SGLang 0.5.23, ``srt/layers/dcp/comm.py``; widened heads are rank-major):

* ``dcp_a2a_lse_reduce(cp_attn_out [T, W*H, D], cp_attn_lse [T, W*H] fp32, cp_group, is_lse_base_on_e,
  cuda_graph_buffers, comm_backend) -> [T, H, D]`` -- called by ``forward_mla`` for ``a2a``/``fi_a2a``;
* ``cp_lse_ag_out_rs_mla(cp_attn_out [T, W*H, D], cp_attn_lse [T, W*H], cp_group, ctx, is_lse_base_on_e)
  -> [H, T, D]`` -- called for every other value, ``vmm`` and ``symm_a2a`` included; the caller transposes;
* ``all_gather_q_for_mla_decode(q_nope_out [T, H, 512], q_pe [T, H, 64]) -> ([T, W*H, 512], [T, W*H, 64])``
  bf16, group ``get_parallel().dcp_group``.

Both merge functions are routed to :class:`peerdcp.OutputReducer` (backend ``direct``; memory ``vmm`` for
``--dcp-comm-backend vmm``, ``symm`` for ``symm_a2a``): the first returns its ``[T, H, D]`` result, the
second a ``[H, T, D]`` transposed view of it (the caller's ``.transpose(0, 1)`` gives back the contiguous
tensor, so no copy is made). ``dcp_a2a_lse_reduce`` is routed when its ``comm_backend`` argument is ``vmm`` /
``symm_a2a``, or when it is not passed and the configured backend is one of them; an explicit ``a2a`` or
``fi_a2a`` always runs SGLang's own code.

The query gather goes to :class:`peerdcp.QueryGather` (backend ``direct``) with BF16 output and an
identity RoPE table (cos 1, sin 0): SGLang's non-fused MLA backends rotate ``q_pe`` *before* the gather, so
the route must move the values unchanged (x*1 - y*0 is exact in fp32; only the sign of a zero can differ).

Calls the peer path cannot serve run SGLang's original function: world size 1, ``T`` above the
workspace's ``max_tokens`` (large prefill rows), dtypes other than bf16/fp16, and every call after a
start-up fallback (``--dcp-peer-fallback a2a``).

Workspaces: one peerdcp object per (group, route, geometry), shared by all layers. They are created by the
pre-capture hook (after ``BaseRunner._pre_initialize_fi_a2a_workspace``, before CUDA-graph capture) with
``max_tokens`` = SGLang's widest captured decode batch; a call with a geometry not created there creates
its object on first use if no capture is running (every rank reaches the same layer in lockstep, so the
collective creation is safe), and raises during capture. They are closed (collectively) before SGLang's
``destroy_model_parallel``.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from . import options as _opt

__all__ = ["Workspaces", "WORKSPACES", "stats", "merge", "gather_query", "group_parts"]

logger = logging.getLogger("peerdcp.sglang")

_MEMORY = {"vmm": "vmm", "symm_a2a": "symm", "vmm_direct": "vmm"}
_HALF = (torch.bfloat16, torch.float16)


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def group_parts(cp_group: Any) -> tuple[Any, Any, int, int]:
    """(torch device group, gloo cpu group or None, world size, rank) of SGLang's ``GroupCoordinator`` --
    or of a plain ``torch.distributed`` ProcessGroup passed where SGLang expects its coordinator."""
    device_group = getattr(cp_group, "device_group", None)
    if device_group is not None:
        return device_group, getattr(cp_group, "cpu_group", None), int(cp_group.world_size), int(cp_group.rank_in_group)
    import torch.distributed as dist

    return cp_group, None, dist.get_world_size(cp_group), dist.get_rank(cp_group)


def _seed_gloo_twin(device_group: Any, cpu_group: Any) -> None:
    """Let peerdcp reuse SGLang's gloo twin of the DCP group instead of creating another one."""
    if cpu_group is None or device_group is cpu_group:
        return
    try:
        from peerdcp._runtime import groups as _dist

        _dist.register_cpu_group(device_group, cpu_group)
    except Exception:  # noqa: BLE001 - an optimisation only
        pass


@dataclass
class Workspaces:
    """The process's peerdcp objects for SGLang, keyed by (route, group, geometry)."""

    objects: dict[tuple, Any] = field(default_factory=dict)
    max_tokens: dict[int, int] = field(default_factory=dict)  # id(device group) -> inbox rows
    fallback: dict[str, str] = field(default_factory=dict)  # route -> reason (peer route disabled)
    counts: dict[str, int] = field(default_factory=dict)  # route -> calls served by peerdcp
    lock: threading.Lock = field(default_factory=threading.Lock)

    # --- start-up --------------------------------------------------------------------------------------
    def check_peer_memory(self, route: str, flag: str, cp_group: Any) -> bool:
        """Collective: can ``route`` use its memory kind on this group? On failure either raise (``error``)
        or record a fallback (``--dcp-peer-fallback a2a``). Returns True when the route is usable."""
        from peerdcp.errors import PeerSetupError

        memory = _opt.memory_override() or _MEMORY[route]
        device_group, cpu_group, _, _ = group_parts(cp_group)
        _seed_gloo_twin(device_group, cpu_group)
        import peerdcp

        device = torch.cuda.current_device() if torch.cuda.is_available() and memory != "host" else None
        caps = peerdcp.probe(device_group, device=device)
        rep = caps.kinds[memory]
        if rep.eligible:
            return True
        reason = f"{memory} peer memory is not eligible on this DCP group: " + "; ".join(rep.reasons)
        if _opt.current().peer_fallback == "a2a":
            logger.warning("peerdcp: %s falls back to SGLang's a2a collectives: %s", flag, reason)
            self.fallback[route] = reason
            return False
        raise PeerSetupError(
            f"peerdcp: {flag} cannot start: {reason}. Use SGLang's --dcp-comm-backend a2a / "
            "--dcp-query-backend allgather, or pass --dcp-peer-fallback a2a to fall back with a warning."
        )

    def prepare(
        self,
        cp_group: Any,
        *,
        heads_per_rank: int,
        kv_lora_rank: int,
        rope_dim: int,
        dtype: torch.dtype,
        lse_base: str | int,
        max_tokens: int,
    ) -> None:
        """Pre-capture step (collective over the DCP group): check eligibility and create every object the
        configured routes need for this geometry."""
        from peerdcp.errors import PeerSetupError

        from .targets import SUPPORTED_SGLANG, sglang_version

        opts = _opt.current()
        device_group, _, W, _ = group_parts(cp_group)
        if W <= 1:
            return
        self.max_tokens[id(device_group)] = max_tokens
        unrouted = [r for r in opts.peer_routes() if r.startswith(("--dcp-indexer-backend", "--dcp-topk-backend"))]
        if unrouted:
            raise PeerSetupError(
                f"peerdcp: {', '.join(unrouted)} cannot be routed in sglang {sglang_version()}: its only DSA+DCP "
                "path (DeepseekSparseAttnBackend._forward_trtllm, SM100) keeps a replicated index-K pool indexed "
                "by global slot and computes the same top-k on every rank, so there is no owner-sharded store, "
                f"local scan or candidate merge to hook (see docs/sglang.md; written against {SUPPORTED_SGLANG}). "
                "Use --dcp-indexer-backend replicated --dcp-topk-backend allgather."
            )
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        try:
            if opts.comm_is_peer and opts.comm_backend not in self.fallback:
                flag = f"--dcp-comm-backend {opts.comm_backend}"
                if self.check_peer_memory(opts.comm_backend, flag, cp_group):
                    self.output(cp_group, opts.comm_backend, heads_per_rank, kv_lora_rank, dtype, lse_base, device)
            q_flag = "--dcp-query-backend vmm_direct"
            if (
                opts.query_backend == "vmm_direct"
                and "vmm_direct" not in self.fallback
                and self.check_peer_memory("vmm_direct", q_flag, cp_group)
            ):
                self.query(cp_group, heads_per_rank, kv_lora_rank, rope_dim, device)
        except PeerSetupError:
            # raised on every rank alike (the probe and the constructors agree first): close what the earlier
            # route created, which nothing else would (start-up is failing), collectively
            self.close_all()
            raise

    # --- objects -------------------------------------------------------------------------------------------
    def rows(self, device_group: Any) -> int:
        return self.max_tokens.get(id(device_group)) or _opt.default_max_tokens()

    def _create(self, key: tuple, make) -> Any:  # noqa: ANN001
        obj = self.objects.get(key)
        if obj is not None:
            return obj
        if _capturing():
            raise RuntimeError(
                f"peerdcp: no workspace for {key[0]} with geometry {key[2:]} was created before CUDA-graph capture; "
                "the pre-capture hook (BaseRunner._pre_initialize_fi_a2a_workspace) sizes them from the model -- "
                "was it skipped?"
            )
        with self.lock:
            obj = self.objects.get(key)
            if obj is None:
                obj = make()
                self.objects[key] = obj
        return obj

    def output(
        self,
        cp_group: Any,
        backend: str,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        lse_base: str | int,
        device: torch.device | None,
    ) -> Any:
        device_group, cpu_group, _, _ = group_parts(cp_group)
        rows = self.rows(device_group)
        memory = _opt.memory_override() or _MEMORY[backend]
        key = ("output", backend, id(device_group), heads, head_dim, dtype, str(lse_base), rows, memory)

        def make():
            import peerdcp

            _seed_gloo_twin(device_group, cpu_group)
            return peerdcp.OutputReducer(
                device_group,
                max_tokens=rows,
                heads_per_rank=heads,
                head_dim=head_dim,
                dtype=dtype,
                backend="direct",
                memory=memory,
                lse_base=lse_base,
                timeout_s=_opt.timeout_s(),
                device=device,
            )

        return self._create(key, make)

    def query(self, cp_group: Any, heads: int, nope_dim: int, rope_dim: int, device: torch.device | None) -> Any:
        device_group, cpu_group, _, _ = group_parts(cp_group)
        rows = self.rows(device_group)
        memory = _opt.memory_override() or _MEMORY["vmm_direct"]
        key = ("query", "vmm_direct", id(device_group), heads, nope_dim, rope_dim, rows, memory)

        def make():
            import peerdcp

            _seed_gloo_twin(device_group, cpu_group)
            qg = peerdcp.QueryGather(
                device_group,
                max_tokens=rows,
                heads_per_rank=heads,
                nope_dim=nope_dim,
                rope_dim=rope_dim,
                out_dtype=torch.bfloat16,
                quant_scale=1.0,
                backend="direct",
                memory=memory,
                timeout_s=_opt.timeout_s(),
                device=device,
            )
            dev = qg_device(qg, device)
            # Identity rotation: SGLang's q_pe is already rotated (or is rotated later by the backend).
            qg._peerdcp_sglang_identity = (
                torch.zeros(rows, dtype=torch.int64, device=dev),
                torch.cat(
                    (torch.ones(1, rope_dim // 2, device=dev), torch.zeros(1, rope_dim // 2, device=dev)), dim=1
                ).float(),
            )
            return qg

        return self._create(key, make)

    # --- shutdown --------------------------------------------------------------------------------------------
    def close_all(self) -> None:
        """Collective: close every object (in creation order, identical on every rank)."""
        objs, self.objects = list(self.objects.values()), {}
        errors = []
        for obj in objs:
            try:
                obj.close()
            except Exception as e:  # noqa: BLE001 - close the rest, then report
                errors.append(f"{type(obj).__name__}: {e}")
        self.max_tokens.clear()
        self.fallback.clear()
        if errors:
            logger.warning("peerdcp: errors while closing SGLang workspaces: %s", "; ".join(errors))

    def count(self, route: str) -> None:
        self.counts[route] = self.counts.get(route, 0) + 1


def qg_device(qg: Any, device: torch.device | None) -> torch.device:
    dev = getattr(qg, "device", None)
    if dev is not None:
        return torch.device(dev)
    return device if device is not None else torch.device("cpu")


WORKSPACES = Workspaces()


def stats() -> dict[str, Any]:
    """What the plugin did in this process: calls served per route, objects, fallbacks (for tests/logs)."""
    return {
        "counts": dict(WORKSPACES.counts),
        "objects": [
            {"route": k[0], "backend": k[1], "memory": getattr(v, "memory", None), "type": type(v).__name__}
            for k, v in WORKSPACES.objects.items()
        ],
        "fallback": dict(WORKSPACES.fallback),
    }


# --- the routed calls ----------------------------------------------------------------------------------------
def merge(backend: str, cp_attn_out: torch.Tensor, cp_attn_lse: torch.Tensor, cp_group: Any, base_e: bool):
    """``[T, W*H, D]``, ``[T, W*H]`` -> ``[T, H, D]`` through peerdcp, or None when the call must run SGLang's
    original (see module docstring)."""
    if backend in WORKSPACES.fallback:
        return None
    _, _, W, _ = group_parts(cp_group)
    if W <= 1 or cp_attn_out.dim() != 3 or cp_attn_out.dtype not in _HALF:
        return None
    n_tokens, WH, D = cp_attn_out.shape
    if n_tokens == 0 or WH % W or n_tokens > WORKSPACES.rows(group_parts(cp_group)[0]):
        return None
    red = WORKSPACES.output(cp_group, backend, WH // W, D, cp_attn_out.dtype, "e" if base_e else 2, cp_attn_out.device)
    out = red.reduce(cp_attn_out.contiguous(), cp_attn_lse.to(torch.float32).contiguous())
    WORKSPACES.count(f"merge:{backend}")
    return out


def gather_query(q_nope: torch.Tensor, q_pe: torch.Tensor, cp_group: Any):
    """``[T, H, nope]``, ``[T, H, rope]`` bf16 -> ``([T, W*H, nope], [T, W*H, rope])`` through peerdcp, or None."""
    if "vmm_direct" in WORKSPACES.fallback:
        return None
    _, _, W, _ = group_parts(cp_group)
    if W <= 1 or q_nope.dim() != 3 or q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
        return None
    n_tokens, H, nope = q_nope.shape
    if n_tokens == 0 or n_tokens > WORKSPACES.rows(group_parts(cp_group)[0]):
        return None
    qg = WORKSPACES.query(cp_group, H, nope, q_pe.shape[-1], q_nope.device)
    positions, table = qg._peerdcp_sglang_identity
    q = qg.gather(q_nope.contiguous(), q_pe.contiguous(), positions[:n_tokens], table)
    WORKSPACES.count("query:vmm_direct")
    return q[..., :nope], q[..., nope:]
