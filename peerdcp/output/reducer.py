"""`OutputReducer`: the DCP Output/LSE exchange (DESIGN.md sections 3, 5, 6).

Each rank holds a partial attention output for the widened head set and needs, for its own heads, the
LSE-weighted combine of every rank's partial. Backends:

* ``"direct"`` - producer-direct over peer memory (``memory`` vmm | symm | host): each rank stores every
  destination's head slice ``[T, H, D]`` and LSE ``[T, H]`` straight into that destination's inbox,
  release-signals, acquire-waits (bounded) for every source, and combines - one fused kernel
  (``csrc/output/direct.cu`` on CUDA, or the Triton twin ``kernels.direct_kernel``; the Triton kernel is
  also the CPU path under ``TRITON_INTERPRET=1``). Device-side epochs with two parity slots: no host
  sync and no barrier between calls; capturable in CUDA graphs. For small T the CUDA kernel uses the
  LL protocol (the flag rides in every 8-byte word: no fence, no flag round trip), above it the sentinel
  protocol (the inbox holds a reserved 16-bit pattern at rest, so every payload vector signals its own
  arrival; for large T a few CTAs publish while the others combine).
* ``"a2a"`` - pack + ``all_to_all_single`` + Triton combine (torch.distributed: NCCL / gloo).
* ``"ag_rs"`` - all-gather of the LSE, local correction, ``reduce_scatter`` (fp32).
* ``"auto"`` - ``direct`` when peer memory is eligible (vmm, then symm; host for CPU), else ``a2a``;
  ``.reason`` says why.

Lifecycle::

    red = OutputReducer(group, max_tokens=256, heads_per_rank=16, head_dim=512)   # collective
    out = red.reduce(partial_out, partial_lse)        # every rank, same T, same order of calls
    red.check()                                       # raises PeerTimeoutError if a wait expired
    red.close()                                       # collective, idempotent

.. important:: Every rank must call :meth:`reduce` the same number of times with the same ``T`` (as a DCP
   decode step does). A rank that does not arrive within ``timeout_s`` makes its peers' kernel give up
   and the reducer raises :class:`~peerdcp.PeerTimeoutError` (waiting rank, missing peer, mechanism
   ``"output"``) at the next call or :meth:`check`; it then refuses every call until re-created. Ranks
   that call with different ``T`` are a usage error; it surfaces as a timeout on at least one rank (the
   flag carries T; under the LL protocol the rank expecting more tokens times out).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton

from .._runtime.device import mechanism_code, on_gpu
from .._runtime.groups import bounded_collective, resolve_group
from .._runtime.lifecycle import Collective
from ..errors import PeerSetupError, PeerTimeoutError
from ..memory import choose_memory
from . import kernels as K
from .config import BACKENDS, DTYPES, KERNELS, agree_config
from .policy import (
    DIRECT_KERNEL_DEFAULT,
    TUNING,
    OutputPolicy,
    default_ll_max_tokens,
    default_policy,
    ll128_band,
    sentinel_split_tokens,
    triton_unit_elems,
)
from .setup import setup_direct

# BACKENDS .. sentinel_split_tokens: re-exported (their former home)
__all__ = [
    "OutputReducer",
    "BACKENDS",
    "KERNELS",
    "DTYPES",
    "DIRECT_KERNEL_DEFAULT",
    "TUNING",
    "default_ll_max_tokens",
    "ll128_band",
    "sentinel_split_tokens",
]

_RS = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_AG = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class OutputReducer(Collective):
    """LSE-weighted reduce of DCP partial attention outputs to each rank's own heads.

    Args:
        group: the DCP ``ProcessGroup`` (None: default group). Collective setup goes over a gloo twin.
        max_tokens: the largest T :meth:`reduce` will see (inbox capacity), ``1 <= max_tokens < 2**20``.
        heads_per_rank: H, heads each rank owns after the reduce (the widened set has W*H).
        head_dim: D (512 for MLA's kv_lora_rank).
        dtype: ``torch.bfloat16`` or ``torch.float16`` (partial and merged outputs).
        backend: ``"auto"`` | ``"direct"`` | ``"a2a"`` | ``"ag_rs"``.
        memory: peer memory for ``direct``: ``"auto"`` | ``"vmm"`` | ``"symm"`` | ``"host"``.
        lse_base: ``"e"`` (natural log: FlashMLA) or ``2`` (log2: FlashInfer, trtllm).
        timeout_s: bound of every wait of the direct backend for a peer, in seconds (0 < timeout_s <= 1e6). The
            collective backends (``a2a``, ``ag_rs``, and ``auto``'s fallback to them) bound each collective by it
            on CPU tensors (gloo; not ``ag_rs``'s reduce-scatter, whose gloo work ignores a bound: its all-gather
            comes first); on the GPU they wait as NCCL does: a missing peer there ends in the process group's own
            timeout and error.
        device: CUDA device (default: current) or ``"cpu"`` (host memory, interpreter kernels).
        kernel: direct kernel: ``"auto"`` (``policy.direct_kernel`` on CUDA, Triton on CPU),
            ``"cuda"`` (``csrc/output/direct.cu``; needs ``D % 8 == 0``, W <= 8) or ``"triton"``.
        programs: grid size G of the direct kernel (default: from ``policy`` and the occupancy).
        ll_max_tokens: CUDA kernel only: calls with ``T <= ll_max_tokens`` use the LL protocol (each 8-byte
            word carries 4 data bytes and the call's flag: no fence, no flag round trip, twice the bytes).
            Default :func:`~peerdcp.output.policy.default_ll_max_tokens`; 0 turns it off.
        ll128_max_tokens: CUDA kernel only: calls with ``lo < T <= ll128_max_tokens`` use the LL128 protocol
            (flags inside 128-byte lines, as NCCL's LL128), ``lo = max(ll_max_tokens,
            policy.cuda_ll128_min_tokens)``; other T the LL or plain protocol. Default
            ``policy.cuda_ll128_max_tokens`` (0: off; the sentinel kernel beat LL128 in its band); the ``"ll128"``
            entry of ``policy.cuda_opts`` makes it every T above ``ll_max_tokens``; off with ``"tight_grid"`` or
            ``"chunked"``.
        policy: the tuning (:class:`~peerdcp.output.policy.OutputPolicy`; None: ``default_policy()``, the defaults
            with ``PEERDCP_OUTPUT_KERNEL`` applied). Experiments pass ``dataclasses.replace(DEFAULT_POLICY, ...)``;
            every rank must pass the same (the fields that shape the kernel are agreed, bad values reported on
            every rank).

    Attributes: ``backend``, ``memory`` (None for collectives), ``kernel`` (direct only), ``reason``,
    ``rank``, ``world_size``, ``programs``, ``policy``.

    Raises:
        TypeError / ValueError: bad or mismatched arguments (on every rank, before anything is allocated).
        PeerSetupError: an explicitly requested peer memory is not usable (on every rank).
    """

    def __init__(
        self,
        group=None,
        *,
        max_tokens: int,
        heads_per_rank: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        backend: str = "auto",
        memory: str = "auto",
        lse_base: str | int = "e",
        timeout_s: float = 10.0,
        device: torch.device | str | int | None = None,
        kernel: str = "auto",
        programs: int | None = None,
        ll_max_tokens: int | None = None,
        ll128_max_tokens: int | None = None,
        policy: OutputPolicy | None = None,
    ) -> None:
        self._closed = True  # until fully constructed
        self._buf = None
        info = resolve_group(group)
        self._info = info
        self.rank, self.world_size = info.rank, info.world_size

        # -- 1. local argument checks, then agreement on them and on the geometry (every rank raises)
        policy = default_policy() if policy is None else policy
        agreed = agree_config(
            info, max_tokens=max_tokens, heads_per_rank=heads_per_rank, head_dim=head_dim, dtype=dtype,
            backend=backend, memory=memory, lse_base=lse_base, timeout_s=timeout_s, device=device, kernel=kernel,
            programs=programs, ll_max_tokens=ll_max_tokens, ll128_max_tokens=ll128_max_tokens, policy=policy,
        )  # fmt: skip
        base, dev = agreed.base, agreed.device
        self.policy = policy
        self.max_tokens, self.heads, self.head_dim, self.dtype = max_tokens, heads_per_rank, head_dim, dtype
        self.lse_base, self.timeout_s, self.device = base, float(timeout_s), dev
        self._base2 = base == "2"
        self._mech = mechanism_code("output")
        # the a2a / ag_rs combine's tile: heads per program and the D block (by the device, not by the call)
        hb = K.heads_per_unit(heads_per_rank, head_dim, triton_unit_elems(policy, dev.type == "cuda"))
        self._combine_tile = (hb, triton.next_power_of_2(head_dim))
        self.memory: str | None = None
        self.kernel: str | None = None
        self.programs: int | None = None
        self.ll_max_tokens = 0
        self.ll128_max_tokens = 0

        # -- 2. backend (auto: direct when peer memory is eligible)
        if backend in ("a2a", "ag_rs"):
            self.backend, self.reason = backend, f"{backend} requested"
        elif backend == "auto" and info.world_size < 2:
            self.backend, self.reason = "a2a", "world size 1: nothing to exchange, a2a (a local copy + combine)"
        else:
            try:
                kind, why = choose_memory(info, memory, dev)
            except PeerSetupError as e:
                if backend == "direct":
                    raise
                self.backend, self.reason = "a2a", f"peer memory not eligible ({e}); falling back to a2a"
            else:
                self.backend, self.memory = "direct", kind
                self.reason = f"direct over {kind} memory" + (f" ({why})" if why else "")
        self.cuda_opts: tuple[str, ...] = ()
        if self.backend == "direct":
            try:
                setup_direct(self, kernel, programs, agreed, policy)
            except PeerSetupError as e:  # (on every rank alike: allocation is all-or-nothing)
                if backend != "auto":
                    raise
                # eligible by the probe, yet the allocation failed (a container's private /dev/shm, a full one,
                # a refused handle exchange): auto falls back as it does for an ineligible memory
                if self._buf is not None:  # (set to None before the backend choice)
                    self._buf.close()
                    self._buf = None
                self.backend, self.memory, self.kernel, self.programs, self.cuda_opts = "a2a", None, None, None, ()
                self.ll_max_tokens = self.ll128_max_tokens = 0
                self.reason = f"peer memory allocation failed ({e}); falling back to a2a"
        self._closed = False

    # --------------------------------------------------------------------------------- checks
    def _timeout_error(self) -> PeerTimeoutError:
        # the Output kernels store the call's flag word (epoch * TOKEN_SPACE + token) as the epoch
        w = [int(x) for x in self._err.words[:5]]
        return PeerTimeoutError(w[1], w[2], "output", w[4] // K.TOKEN_SPACE, self.timeout_s)

    def _validate(self, partial_out, partial_lse, return_lse) -> int:
        W, H, D = self.world_size, self.heads, self.head_dim
        if not isinstance(partial_out, torch.Tensor):
            raise TypeError(f"partial_out must be a torch.Tensor, got {type(partial_out).__name__}")
        if not isinstance(partial_lse, torch.Tensor):
            raise TypeError(f"partial_lse must be a torch.Tensor, got {type(partial_lse).__name__}")
        if not isinstance(return_lse, bool):
            raise TypeError(f"return_lse must be a bool, got {type(return_lse).__name__}")
        if partial_out.dtype != self.dtype:
            raise TypeError(f"partial_out must be {self.dtype} (the reducer's dtype), got {partial_out.dtype}")
        if partial_lse.dtype != torch.float32:
            raise TypeError(f"partial_lse must be torch.float32, got {partial_lse.dtype}")
        if partial_out.dim() != 3 or partial_out.shape[1] != W * H or partial_out.shape[2] != D:
            raise ValueError(f"partial_out must be [T, W*H={W * H}, D={D}], got {list(partial_out.shape)}")
        T = partial_out.shape[0]
        if self.max_tokens < T:
            raise ValueError(f"partial_out has T={T} tokens, more than max_tokens={self.max_tokens}")
        if tuple(partial_lse.shape) != (T, W * H):
            raise ValueError(f"partial_lse must be [T={T}, W*H={W * H}], got {list(partial_lse.shape)}")
        for name, t in (("partial_out", partial_out), ("partial_lse", partial_lse)):
            if t.device != self.device:
                raise ValueError(f"{name} must be on {self.device} (the reducer's device), got {t.device}")
            if T > 0 and not t.is_contiguous():
                raise ValueError(
                    f"{name} must be contiguous (token-major, packed heads), got strides {tuple(t.stride())}; "
                    f"call .contiguous() first"
                )
        if self.kernel == "cuda" and T > 0 and partial_out.data_ptr() % 16:
            raise ValueError(
                "partial_out must be 16-byte aligned for the CUDA kernel "
                f"(data_ptr % 16 = {partial_out.data_ptr() % 16})"
            )
        return T

    # ---------------------------------------------------------------------------------- reduce
    def reduce(
        self, partial_out: torch.Tensor, partial_lse: torch.Tensor, *, return_lse: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Combine every rank's partial for this rank's heads.

        Args:
            partial_out: ``[T, W*H, D]`` in the reducer's dtype, contiguous; widened heads rank-major
                (head ``s*H + h`` belongs to rank s). Rows of an empty shard may hold anything (NaN).
            partial_lse: ``[T, W*H]`` fp32, contiguous; NaN / +inf / -inf mark an empty shard.
            return_lse: also return the merged LSE.

        Returns:
            ``out [T, H, D]`` (heads ``[rank*H, (rank+1)*H)``; 0 where every source is empty), and with
            ``return_lse`` the merged ``lse [T, H]`` fp32 (-inf where every source is empty).

        Every rank must make the same calls with the same T. Capturable in a CUDA graph (no host sync,
        outputs allocated from the graph's pool).
        """
        self._ready("reduce")
        T = self._validate(partial_out, partial_lse, return_lse)
        H, D = self.heads, self.head_dim
        out = torch.empty((T, H, D), dtype=self.dtype, device=self.device)
        out_lse = torch.empty((T, H), dtype=torch.float32, device=self.device) if return_lse else None
        if T > 0:
            if self.backend == "direct":
                self._direct(partial_out, partial_lse, out, out_lse, T)
            elif self.backend == "a2a":
                self._a2a(partial_out, partial_lse, out, out_lse, T)
            else:
                self._ag_rs(partial_out, partial_lse, out, out_lse, T)
        return (out, out_lse) if return_lse else out

    __call__ = reduce

    def _direct(self, po, pl, out, out_lse, T) -> None:
        if self.kernel == "cuda":
            if torch.compiler.is_compiling():
                L = self._layout
                torch.ops.peerdcp.output_direct(
                    po, pl, out, out_lse if out_lse is not None else self._dummy_lse, self._epochs,
                    self._buf.peer_addrs, self._err.kernel_arg(), self.rank, self.programs, self._hpu,
                    self.max_tokens, L.lse_off, L.payload_off, self._timeout_ns, self._base2,
                    out_lse is not None, self._mech, L.ll_off, self.ll_max_tokens, self._opts_mask, L.ll128_off,
                    self.ll128_max_tokens, self._ll128_min, L.sn_off, L.sn_lse_off, self._sn_min,
                    [x for entry in self._sn_split for x in entry],
                )  # fmt: skip
            else:
                self._launch_cuda(po, pl, out, out_lse)
            return
        W, H, D, G = self.world_size, self.heads, self.head_dim, self.programs
        K.direct_kernel[(G,)](
            po, pl, out, out_lse if out_lse is not None else self._dummy_lse,
            self._buf.peer_ptrs, self._epochs, self._err.kernel_arg(),
            T, self.rank, G, self.max_tokens, self._layout.lse_off, self._layout.payload_off,
            self._timeout_ns, self._max_spins,
            W=W, H=H, D=D, HB=self._hpu, BLOCK_D=triton.next_power_of_2(D), NC=triton.cdiv(H, self._hpu),
            BASE2=self._base2, RETURN_LSE=out_lse is not None, MECH=self._mech, GPU=self._gpu,
        )  # fmt: skip
        if not self._gpu:  # the interpreter ran synchronously: report a timeout now
            self._ready("reduce")

    def _collective(self, op, out: torch.Tensor, inp: torch.Tensor) -> None:
        """One collective of the a2a / ag_rs backends: on CPU tensors over the gloo group, bounded by ``timeout_s``
        (a missing peer: PeerTimeoutError, and the reducer refuses further calls); on the GPU over the caller's group
        (NCCL: the process group's timeout)."""
        group = self._info.group if self.device.type == "cuda" else self._info.cpu_group
        try:
            bounded_collective(op, out, inp, group=group, timeout_s=self.timeout_s, rank=self.rank, mechanism="output")
        except PeerTimeoutError as e:
            self._failure = e
            raise

    def _a2a(self, po, pl, out, out_lse, T) -> None:
        W, H, D = self.world_size, self.heads, self.head_dim
        pb = H * D * po.element_size()
        rb = -(-(pb + 4 * H) // 16) * 16  # one row per (peer, token): payload then LSE, 16-byte rows
        send = torch.empty((W, T, rb), dtype=torch.uint8, device=self.device)
        recv = torch.empty_like(send)
        send[:, :, :pb].view(self.dtype).unflatten(-1, (H, D)).copy_(po.view(T, W, H, D).transpose(0, 1))
        send[:, :, pb : pb + 4 * H].view(torch.float32).copy_(pl.view(T, W, H).transpose(0, 1))
        self._collective(dist.all_to_all_single, recv.view(-1), send.view(-1))
        rp = recv[:, :, :pb].view(self.dtype).unflatten(-1, (H, D))  # [W, T, H, D]
        rl = recv[:, :, pb : pb + 4 * H].view(torch.float32)  # [W, T, H]
        hb, bd = self._combine_tile
        K.combine_kernel[(T, triton.cdiv(H, hb))](
            rp, rl, out, out_lse if out_lse is not None else self._dummy(),
            rp.stride(0), rp.stride(1), rp.stride(2), rl.stride(0), rl.stride(1), rl.stride(2),
            N=W, H=H, D=D, HB=hb, BLOCK_D=bd, BASE2=self._base2, RETURN_LSE=out_lse is not None,
            GPU=on_gpu(self.device),
        )  # fmt: skip

    def _ag_rs(self, po, pl, out, out_lse, T) -> None:
        W, H, D = self.world_size, self.heads, self.head_dim
        lses = torch.empty((W, T, W * H), dtype=torch.float32, device=self.device)
        self._collective(_AG, lses.view(-1), pl.view(-1))
        corrected = torch.empty((W, T, H, D), dtype=torch.float32, device=self.device)
        hb, bd = self._combine_tile
        K.correct_kernel[(T, W * triton.cdiv(H, hb))](
            po, lses, corrected, out_lse if out_lse is not None else self._dummy(), T, self.rank,
            W=W, H=H, D=D, HB=hb, BLOCK_D=bd, BASE2=self._base2, RETURN_LSE=out_lse is not None,
            GPU=on_gpu(self.device),
        )  # fmt: skip
        red = torch.empty((T, H, D), dtype=torch.float32, device=self.device)
        self._collective(_RS, red.view(-1), corrected.view(-1))
        out.copy_(red)

    def _dummy(self) -> torch.Tensor:
        d = getattr(self, "_dummy_lse", None)
        if d is None:
            d = self._dummy_lse = torch.empty(1, dtype=torch.float32, device=self.device)
        return d

    def __repr__(self) -> str:
        return (
            f"OutputReducer(backend={self.backend!r}, memory={self.memory!r}, kernel={self.kernel!r}, "
            f"W={self.world_size}, H={self.heads}, D={self.head_dim}, dtype={self.dtype}, "
            f"max_tokens={self.max_tokens}, lse_base={self.lse_base!r}, closed={self._closed})"
        )
