"""`QueryGather`: the widened MLA query of a DCP group, gathered and rotated in one fused kernel.

Lifecycle (every step collective over the group, in the same order on every rank):

1. ``qg = QueryGather(group, max_tokens=..., heads_per_rank=...)`` - before any CUDA-graph capture:
   agrees on the geometry, picks the backend / memory / kernel and allocates the exposed buffer.
2. Per decode step and layer, either

   * ``q = qg.gather(q_nope, q_pe, positions, cos_sin_cache)`` (the kernel copies or rotates this
     rank's shard into its exposed buffer itself), or
   * zero-copy: ``q_nope_buf, q_pe_buf = qg.exposed_shard(T)``; the model writes its projection
     straight into these views; ``q = qg.gather_exposed(positions, cos_sin_cache)``.

   Both are capturable in CUDA graphs and may run back to back with changing inputs: there is no host
   synchronization (a device-side call counter selects the parity slot; see ``kernels.py``).
3. ``qg.check()`` whenever convenient (raises :class:`peerdcp.PeerTimeoutError` if a peer stopped
   answering); ``qg.close()`` (collective, idempotent), or use the object as a context manager.

.. important::
   All ranks must make the same sequence of calls with the same T, on one stream per rank (the one
   current at the call). A rank that stops calling makes its peers' waits time out after
   ``timeout_s``: they raise ``PeerTimeoutError`` at their next call (on CPU: at once) and the object
   refuses every call after that; re-create it.
"""

from __future__ import annotations

import torch

from .. import memory as _memory
from .._runtime.checks import is_int, resolve_device
from .._runtime.device import on_gpu
from .._runtime.groups import all_gather_object, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from . import allgather as _ag
from . import kernels as K
from . import setup as _setup
from .config import BACKENDS, EXCHANGES, IMPLS, OUT_DTYPES, check_common, check_shard, validate_config
from .policy import (
    AUTO_PUSH_RAW_MAX_TOKENS,
    AUTO_RAW_MAX_TOKENS,
    PUSH_AUTO_MAX_GROWTH,
    DirectPlan,
    QueryPolicy,
    copy_mode,
    default_policy,
    launch_bits,
    launch_blocks,
    plan_direct,
    tuning_bytes,
)

# (BACKENDS ... PUSH_AUTO_MAX_GROWTH, copy_mode, launch_blocks, tuning_bytes: re-exported from their modules)
__all__ = [
    "QueryGather",
    "copy_mode",
    "launch_blocks",
    "tuning_bytes",
    "BACKENDS",
    "IMPLS",
    "EXCHANGES",
    "OUT_DTYPES",
    "AUTO_RAW_MAX_TOKENS",
    "AUTO_PUSH_RAW_MAX_TOKENS",
    "PUSH_AUTO_MAX_GROWTH",
]


class QueryGather(Collective):
    """Gather every rank's query heads of a DCP group, apply RoPE and convert, in one fused kernel.

    Args:
        group: ``torch.distributed`` ProcessGroup (None: the default group). W = its size.
        max_tokens: the largest T a call may pass (sizes the exposed buffer).
        heads_per_rank: H, this rank's query heads (the same on every rank).
        nope_dim: width of ``q_nope`` (512: the absorbed latent).  rope_dim: width of ``q_pe`` (64, even).
        rope_style: ``"interleaved"`` (GPT-J pairs; MLA) or ``"neox"`` (half split).
        out_dtype: ``torch.float8_e4m3fn`` (saturating, ``quant_scale`` applied) or ``torch.bfloat16``.
        quant_scale: per-tensor multiplier before the FP8 cast (must be 1.0 for bf16 output).
        backend: ``"direct"`` (peer memory: see ``exchange``; SGLang's ``vmm_direct``),
            ``"allgather"`` (all-gather of the bf16 shards, then one fused RoPE + convert kernel), or
            ``"auto"`` (direct when peer memory is eligible on every rank, else allgather; see ``reason``).
        memory: ``"auto" | "vmm" | "symm" | "host"`` for the direct backend's exposed buffer.
        timeout_s: bound on every wait for a peer (direct backend), in seconds (0 < timeout_s <= 1e6). The
            allgather backend (also ``auto``'s fallback) bounds its all-gather by it on CPU tensors (gloo); on the
            GPU it waits as NCCL does: a missing peer there ends in the process group's own timeout and error.
        pad_heads_to: None, 64 or 128: zero-pad the widened heads to this count (FlashMLA's sparse decode
            takes 64 or 128 heads); must be >= W * H.
        impl: kernel: direct ``"cuda"`` (csrc/query/direct.cu) or ``"triton"``; allgather ``"triton"``
            (fused) or ``"torch"`` (the plain reference ops); ``"auto"`` picks the fastest available (on a
            GPU the CUDA kernel; the Triton direct kernel where it cannot be built, and under the interpreter).
        exchange: direct backend, what the peers read: ``"raw"`` (the un-rotated bf16 shard; consumers
            rotate and convert), ``"roped"`` (rows the producer already rotated and converted), ``"push"``
            (the producer rotates and converts its rows and stores them into every consumer's slot: NVLink
            stores instead of loads; its two slots hold W sources' rows, W * out-size / 2 times a raw slot;
            the CUDA kernel sends calls within the byte bounds of ``policy`` with flag-in-data protocols: LL,
            SN - the sentinel push, no flag bytes, the default up to 256 tokens of 32 heads -, LL12, LL128),
            ``"auto"`` (with the CUDA kernel, those protocols within their bounds; above them
            push where its slots cost at most ``policy.push_auto_max_growth`` raw slots - W = 2
            with FP8 - else raw for T <= ``policy.auto_raw_max_tokens`` and roped above; see
            :func:`~peerdcp.query.policy.copy_mode`).
            All give the same bytes provided every rank passes the same ``positions`` and
            ``cos_sin_cache`` (as in DCP, where every rank holds every token): raw and allgather rotate
            every row with the *caller's* positions, roped and push with the *producer's*; and SN with BF16
            output sends a 0xFFFF input half (a NaN) as the canonical NaN 0x7FC0.
        device: the tensors' device (default: the current CUDA device, else CPU).
        num_programs: direct backend grid size (default on GPU: 2 per SM, or for an object whose copy calls use
            the CUDA sentinel push up to ``policy.cuda_sn_programs_per_sm`` per SM, as many as are resident
            at once, of which an SN call launches only what it needs (:func:`launch_blocks`); 4 in the
            interpreter).
        policy: the tuning (:class:`~peerdcp.query.policy.QueryPolicy`; None: ``default_policy()``, the defaults
            with ``PEERDCP_QUERY_IMPL`` applied). Agreed by every rank; read at construction.

    Attributes:
        backend, memory (None for allgather), impl, exchange, reason (why auto chose what it chose),
        world_size, rank, heads_per_rank, out_heads (W*H or the padding), head_dim (nope + rope).

    Raises:
        ValueError / TypeError: bad arguments, or geometry that differs across ranks (on every rank).
        PeerSetupError: a collective setup step failed on some rank (raised on every rank).
    """

    def __init__(
        self,
        group=None,
        *,
        max_tokens: int,
        heads_per_rank: int,
        nope_dim: int = 512,
        rope_dim: int = 64,
        rope_style: str = "interleaved",
        out_dtype: torch.dtype = torch.float8_e4m3fn,
        quant_scale: float = 1.0,
        backend: str = "auto",
        memory: str = "auto",
        timeout_s: float = 10.0,
        pad_heads_to: int | None = None,
        impl: str = "auto",
        exchange: str = "auto",
        device: torch.device | str | int | None = None,
        num_programs: int | None = None,
        policy: QueryPolicy | None = None,
    ) -> None:
        self._closed = True
        self._buf = None
        self._failure: PeerTimeoutError | None = None
        info = resolve_group(group)
        self._info = info
        self.world_size, self.rank = info.world_size, info.rank
        config = dict(
            max_tokens=max_tokens,
            heads_per_rank=heads_per_rank,
            nope_dim=nope_dim,
            rope_dim=rope_dim,
            rope_style=rope_style,
            out_dtype=out_dtype,
            quant_scale=quant_scale,
            backend=backend,
            memory=memory,
            timeout_s=timeout_s,
            pad_heads_to=pad_heads_to,
            impl=impl,
            exchange=exchange,
            num_programs=num_programs,
            policy=policy,
        )
        local_err: BaseException | None = None
        geometry = None
        try:
            dev = resolve_device(device)
            config["policy"] = policy = default_policy() if policy is None else policy  # (may raise: bad env)
            validate_config(self.world_size, **config, device=dev)
            # what every rank must agree on (timeout_s need not be the same)
            geometry = {k: v for k, v in config.items() if k != "timeout_s"}
            geometry.update(out_dtype=str(out_dtype), quant_scale=float(quant_scale), device_type=dev.type)
        except (ValueError, TypeError) as e:
            local_err = e
        peers = all_gather_object(
            info, (None if local_err is None else f"{type(local_err).__name__}: {local_err}", geometry)
        )
        if local_err is not None:
            raise local_err
        bad = [(r, m) for r, (m, _) in enumerate(peers) if m is not None]
        if bad:
            raise PeerSetupError("QueryGather: bad arguments on " + "; ".join(f"rank {r}: {m}" for r, m in bad))
        for key in geometry:
            vals = [g[key] for _, g in peers]
            if len(set(map(repr, vals))) != 1:
                raise ValueError(f"QueryGather: {key} must be the same on every rank, got {vals} (by rank)")

        self.device = dev
        self.max_tokens = max_tokens
        self.heads_per_rank = H = heads_per_rank
        self.nope_dim, self.rope_dim = nope_dim, rope_dim
        self.head_dim = nope_dim + rope_dim
        self.rope_style = rope_style
        self.out_dtype = out_dtype
        # the kernels multiply in fp32: keep the scale as the fp32 value they use
        self.quant_scale = float(torch.tensor(float(quant_scale), dtype=torch.float32))
        self.timeout_s = float(timeout_s)
        self.out_heads = pad_heads_to if pad_heads_to is not None else self.world_size * H
        self._gpu = on_gpu(dev)
        self._exposed_T: int | None = None
        self.policy = policy
        self._plan = DirectPlan(exchange=exchange)  # the direct backend's construction-time choices (below)
        self._sn_floor = 0  # an SN call's grid is at least this many blocks (on CUDA: the policy's per SM x SMs)
        self._launch_cuda = None  # impl="cuda": the DirectLauncher

        reasons: list[str] = []
        chosen = backend
        kind = None
        if backend in ("auto", "direct"):
            try:
                kind, why = _memory.choose_memory(info, memory, dev)
                chosen = "direct"
                reasons.append(f"direct over {kind} memory ({why})")
            except PeerSetupError as e:
                if backend == "direct":
                    raise
                chosen = "allgather"
                reasons.append(f"allgather: peer memory is not eligible ({e})")
        else:
            reasons.append("allgather requested")
        self.backend = chosen
        self.memory = kind if chosen == "direct" else None
        self.impl = _setup.choose_impl(self, impl, reasons)
        self.exchange = exchange if chosen == "direct" else None
        if chosen == "direct":
            self._plan, why = plan_direct(
                policy,
                exchange=exchange,
                impl=self.impl,
                world_size=self.world_size,
                heads=H,
                head_dim=self.head_dim,
                max_tokens=max_tokens,
                out_dtype=out_dtype,
                rope_style=rope_style,
            )
            reasons += why
            _setup.setup_direct(self, num_programs, reasons)
        else:
            self._setup_allgather()
        self.reason = "; ".join(reasons)
        self._closed = False

    # ------------------------------------------------------------------------------------ setup
    def _setup_allgather(self) -> None:
        H, D, dev = self.heads_per_rank, self.head_dim, self.device
        self.num_programs = None
        self._staging = torch.empty((self.max_tokens, H, D), dtype=torch.bfloat16, device=dev)
        self._gathered = torch.empty(self.world_size * self.max_tokens * H * D, dtype=torch.bfloat16, device=dev)
        self._err = None

    # ------------------------------------------------------------------------------ lifetime
    def _release(self) -> None:
        self._z_nope = self._z_pe = self._launch_cuda = None
        self._staging = self._gathered = None

    def __repr__(self) -> str:
        return (
            f"QueryGather(backend={self.backend!r}, memory={self.memory!r}, impl={self.impl!r}, "
            f"exchange={self.exchange!r}, W={self.world_size}, H={self.heads_per_rank}, "
            f"D={self.nope_dim}+{self.rope_dim}, out={self.out_dtype}, {'closed' if self._closed else 'open'})"
        )

    def _new_out(self, T: int, out):
        if out is None:
            out = torch.empty((T, self.out_heads, self.head_dim), dtype=self.out_dtype, device=self.device)
        return out

    def _bits(self, out: torch.Tensor) -> torch.Tensor:
        return out.view(torch.uint8) if self.out_dtype == torch.float8_e4m3fn else out.view(torch.int16)

    # ------------------------------------------------------------------------------------ calls
    def gather(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        positions: torch.Tensor,
        cos_sin_cache: torch.Tensor,
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The widened query of the group (collective: every rank calls it with the same T).

        Args:
            q_nope: ``[T, H, nope]`` bf16, this rank's heads (last dim contiguous, strides multiples of 8).
            q_pe: ``[T, H, rope]`` bf16, un-rotated.
            positions: ``[T]`` int32/int64, rows of ``cos_sin_cache`` (checked on CPU; on GPU not checked
                - that would synchronize - and clamped into the table).
            cos_sin_cache: ``[max_pos, rope]`` fp32, rows ``[cos | sin]`` (see :mod:`peerdcp.query.rope`).
            out: optional ``[T, out_heads, nope + rope]`` output (``out_dtype``, contiguous).

        Returns:
            ``q [T, out_heads, nope + rope]`` in ``out_dtype``: widened head ``s*H + h`` is head h of rank s,
            ``[nope | rotated rope]``, padding heads zero.

        Raises:
            ValueError / TypeError: bad input, before any launch or peer store.
            PeerTimeoutError: a wait of this or an earlier call timed out (see the module docstring).
        """
        self._ready("gather")
        T = check_shard(self, "q_nope", q_nope, self.nope_dim)
        T2 = check_shard(self, "q_pe", q_pe, self.rope_dim)
        if T2 != T:
            raise ValueError(f"q_pe has {T2} tokens, q_nope has {T}")
        check_common(self, T, positions, cos_sin_cache, out)
        out = self._new_out(T, out)
        if T == 0:
            return out
        if self.backend == "direct":
            mode = self._copy_mode(T)
            self._launch_direct(mode, q_nope, q_pe, positions, cos_sin_cache, out, T)
        else:
            self._allgather(q_nope, q_pe, positions, cos_sin_cache, out, T)
        return out

    def exposed_shard(self, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zero-copy producer API (direct backend): views of this rank's exposed bf16 shard.

        Enqueues (on the current stream) a bounded wait until every peer finished reading the previous
        exposed shard, then returns ``(q_nope [T, H, nope], q_pe [T, H, rope])`` bf16 views; write the
        projection into them on the same stream, then call :meth:`gather_exposed` with the same T.
        The views alias the same memory every call (CUDA-graph friendly), and only until :meth:`close`: the
        memory under them is unmapped then, and a store through a kept view faults the process.
        """
        self._ready("exposed_shard")
        if self.backend != "direct":
            raise ValueError(f"exposed_shard needs backend='direct', this object uses {self.backend!r}")
        if not is_int(num_tokens):
            raise TypeError(f"num_tokens must be an int, got {type(num_tokens).__name__}")
        if not 1 <= num_tokens <= self.max_tokens:
            raise ValueError(f"num_tokens must be in [1, {self.max_tokens}], got {num_tokens}")
        self._launch_wait_acks()
        self._exposed_T = num_tokens
        return self._z_nope[:num_tokens], self._z_pe[:num_tokens]

    def gather_exposed(
        self, positions: torch.Tensor, cos_sin_cache: torch.Tensor, *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """:meth:`gather` of the shard written into the :meth:`exposed_shard` views (T = ``positions.shape[0]``)."""
        self._ready("gather_exposed")
        if self.backend != "direct":
            raise ValueError(f"gather_exposed needs backend='direct', this object uses {self.backend!r}")
        if self._exposed_T is None:
            raise ValueError("gather_exposed: call exposed_shard(T) first (and write the shard into its views)")
        T = self._exposed_T
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"positions must be a torch.Tensor, got {type(positions).__name__}")
        if positions.dim() != 1 or positions.shape[0] != T:
            raise ValueError(
                f"positions must have shape [T] = [{T}] (the T of exposed_shard), got {list(positions.shape)}"
            )
        check_common(self, T, positions, cos_sin_cache, out)
        out = self._new_out(T, out)
        self._exposed_T = None
        self._launch_direct(K.MODE_EXPOSED, self._z_nope, self._z_pe, positions, cos_sin_cache, out, T)
        return out

    def _copy_mode(self, T: int) -> int:
        """The kernel mode of a copy call with T tokens (see :func:`copy_mode`)."""
        p = self._plan
        return copy_mode(
            self.exchange,
            T,
            push_slots=p.push_slots,
            ll_max=p.ll_max,
            ll12_max=p.ll12_max,
            ll128_max=p.ll128_max,
            sn_max=p.sn_max,
            policy=self.policy,
        )

    # ---------------------------------------------------------------------------------- launches
    def _launch_blocks(self, mode: int, T: int) -> int:
        """The CUDA grid of a call of ``mode`` with T tokens (:func:`launch_blocks`)."""
        return launch_blocks(mode, T, self.heads_per_rank, self.num_programs, self._plan.sn_upb, self._sn_floor)

    def _launch_direct(self, mode, q_nope, q_pe, positions, cos_sin_cache, out, T) -> None:
        buf, lay = self._buf, self._layout
        if self.impl == "cuda":
            bits = launch_bits(self._plan, mode, T)
            self._launch_cuda(mode | bits, T, q_nope, q_pe, positions, cos_sin_cache, out, self._launch_blocks(mode, T))
        else:
            K.direct_kernel[(self.num_programs,)](
                q_nope,
                q_pe,
                q_nope.stride(0),
                q_nope.stride(1),
                q_pe.stride(0),
                q_pe.stride(1),
                positions,
                cos_sin_cache,
                cos_sin_cache.shape[0],
                self._bits(out),
                buf.peer_ptrs,
                self._epochs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self._spins,
                self.quant_scale,
                T,
                self.rank,
                self.max_tokens,
                lay.data_off,
                lay.slot_bytes,
                W=self.world_size,
                H=self.heads_per_rank,
                HOUT=self.out_heads,
                NOPE=self.nope_dim,
                ROPE=self.rope_dim,
                NPROG=self.num_programs,
                BU=self._bu,
                MODE=mode,
                NEOX=self.rope_style == "neox",
                OUT_FP8=self.out_dtype == torch.float8_e4m3fn,
                MECH=self._mech,
                GPU=self._gpu,
                num_warps=4,
                enable_fp_fusion=False,
            )
        self._after_launch()

    def _launch_wait_acks(self) -> None:
        if self.impl == "cuda":
            self._launch_cuda.wait_acks()
        else:
            K.wait_acks_kernel[(self.num_programs,)](
                self._buf.peer_ptrs,
                self._last_z,
                self._err.kernel_arg(),
                self._timeout_ns,
                self._spins,
                self.rank,
                W=self.world_size,
                NPROG=self.num_programs,
                MECH=self._mech,
                GPU=self._gpu,
                num_warps=1,
            )
        self._after_launch()

    def _after_launch(self) -> None:
        # The interpreter runs the kernel synchronously: report a timeout at once. On the GPU the host
        # never waits; the next call (or check()) reads the pinned error word.
        if not self._gpu:
            self._ready("gather")

    def _allgather(self, q_nope, q_pe, positions, cos_sin_cache, out, T) -> None:
        W, H, D = self.world_size, self.heads_per_rank, self.head_dim
        staging = self._staging[:T]
        torch.cat((q_nope, q_pe), dim=-1, out=staging)
        gathered = self._gathered[: W * T * H * D]
        try:
            _ag.all_gather_into(gathered, staging, self._info, self.timeout_s)
        except PeerTimeoutError as e:
            self._failure = e
            raise
        _ag.rope_convert(self, gathered.view(W, T, H, D), positions, cos_sin_cache, out)
