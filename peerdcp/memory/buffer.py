"""`PeerBuffer`: one peer-visible allocation per rank, addressable by every rank of the group.

All three memory kinds (``vmm``, ``symm``, ``host``) return this class; a backend object supplies the
mapping and its teardown. Views alias the mapped bytes: they are valid until :meth:`PeerBuffer.close`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch

from .._runtime.groups import GroupInfo, agree, agree_args
from ..errors import PeerDCPError, PeerSetupError

__all__ = ["PEER_ALIGN", "PeerBuffer"]

PEER_ALIGN = 16  # bytes; every mapping is page (host) or granularity (vmm, symm) aligned, far beyond this


class PeerBuffer:
    """A collective allocation of ``nbytes`` per rank, mapped on every rank.

    Attributes:
        rank, world_size: this process's rank in the group and the group size W.
        memory: ``"vmm"``, ``"symm"`` or ``"host"``.
        nbytes: requested bytes per rank (the mapping may be larger, rounded to the granularity).
        device: ``torch.device`` of the tensors (``cpu`` for host memory).
        local: ``uint8 [nbytes]`` tensor of this rank's bytes.
        peer_ptrs: ``int64 [W]`` tensor on ``device``: base address of rank r's bytes *in this process*, each
            16-byte aligned (checked here: the Triton kernels declare it to the compiler, ``peer_pointer``).
    """

    def __init__(
        self,
        *,
        info: GroupInfo,
        memory: str,
        nbytes: int,
        device: torch.device,
        peer_bytes: Sequence[torch.Tensor],
        peer_addrs: Sequence[int],
        teardown: Callable[[], None],
    ) -> None:
        self._info = info
        self.rank = info.rank
        self.world_size = info.world_size
        self.memory = memory
        self.nbytes = nbytes
        self.device = device
        self._peer_bytes = list(peer_bytes)
        self._peer_addrs = [int(a) for a in peer_addrs]
        # Agreed, so that a rank whose mapping broke the rule cannot leave the others with a buffer it never joins;
        # every rank then tears its mappings down (collectively: all of them are here).
        bad = [hex(a) for a in self._peer_addrs if a % PEER_ALIGN]
        err = f"peer base addresses {bad} are not {PEER_ALIGN}-byte aligned" if bad else None
        try:
            agree(info, err, f"{memory} map")
        except PeerSetupError:
            teardown()
            raise
        self.peer_ptrs = torch.tensor(self._peer_addrs, dtype=torch.int64, device=device)
        self._teardown: Callable[[], None] | None = teardown

    # --- views -------------------------------------------------------------------------------
    @property
    def local(self) -> torch.Tensor:
        return self.view(self.rank, (self.nbytes,), torch.uint8)

    @property
    def closed(self) -> bool:
        return self._teardown is None

    @property
    def peer_addrs(self) -> list[int]:
        """Python ints of ``peer_ptrs`` (no device read)."""
        return list(self._peer_addrs)

    def view(self, peer: int, shape: Sequence[int] | int, dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
        """A tensor aliasing rank ``peer``'s bytes ``[offset, offset + numel*itemsize)``.

        Raises ValueError when the range leaves the allocation or ``offset`` is not aligned to ``dtype``.
        """
        if self.closed:
            raise ValueError("PeerBuffer is closed")
        if not 0 <= peer < self.world_size:
            raise ValueError(f"peer must be in [0, {self.world_size}), got {peer}")
        shape = (shape,) if isinstance(shape, int) else tuple(int(s) for s in shape)
        if any(s < 0 for s in shape):
            raise ValueError(f"shape must be non-negative, got {shape}")
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = 1
        for s in shape:
            numel *= s
        if offset < 0 or offset % itemsize:
            raise ValueError(f"offset must be a non-negative multiple of {itemsize} for {dtype}, got {offset}")
        end = offset + numel * itemsize
        if end > self.nbytes:
            raise ValueError(f"view [{offset}, {end}) leaves the allocation of {self.nbytes} bytes")
        return self._peer_bytes[peer][offset:end].view(dtype).view(shape)

    def fill_collective(self, offset: int, nbytes: int, value: int) -> None:
        """Collective: set this rank's bytes ``[offset, offset + nbytes)`` to ``value`` (0..255) on every rank,
        then return only once every rank's fill has landed (device sync, then a barrier of the group), so no
        peer can store into the range before it holds ``value`` (a rest state that protocols rely on)."""
        err: BaseException | None = None
        try:
            if not 0 <= value <= 255:
                raise ValueError(f"value must be a byte (0..255), got {value}")
            self.view(self.rank, (nbytes,), torch.uint8, offset).fill_(value)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except (TypeError, ValueError) as e:  # raised here, a PeerSetupError on the other ranks (none waits)
            err = e
        agree_args(self._info, err, "PeerBuffer.fill_collective")

    # --- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Collective and idempotent: every rank must call it. Unmaps peers, releases memory, closes fds; returns
        once every rank has done so.

        Raises:
            PeerSetupError: a peer did not take part (its process died, e.g. after a ``PeerTimeoutError``). This
                rank's mappings are released all the same. A peer that is alive but never calls ``close()`` makes
                it wait for the process group's own timeout.
        """
        teardown, self._teardown = self._teardown, None
        if teardown is None:
            return
        self._peer_bytes = []
        try:
            teardown()  # (a barrier, then this rank's unmaps, which run even when the barrier fails)
            # A rank's memory goes back to the system only when every peer has dropped its mapping of it too: wait
            # for all, so that once close() returns on any rank the allocation is released everywhere. Without it
            # a rank measures its next allocation with its last one still mapped by a slower peer (symm, 4 MiB).
            agree(self._info, None, f"{self.memory} close (released)")
        except PeerDCPError:
            raise
        except RuntimeError as e:  # the group's own failure (gloo: "Connection closed by peer")
            raise PeerSetupError(
                f"{self.memory} close: a peer did not take part ({type(e).__name__}: {e}); this rank's mappings "
                "are released"
            ) from e

    def __enter__(self) -> PeerBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_teardown", None) is not None:
            # Teardown is collective; doing it from a finalizer could hang. Warn instead.
            warnings.warn(
                f"PeerBuffer ({self.memory}, {self.nbytes} B) was garbage-collected without close(); "
                "its mapping stays until the process exits",
                ResourceWarning,
                stacklevel=1,
            )

    def __repr__(self) -> str:
        state = "closed" if self.closed else "open"
        return (
            f"PeerBuffer(memory={self.memory!r}, nbytes={self.nbytes}, rank={self.rank}, "
            f"world_size={self.world_size}, device={self.device}, {state})"
        )
