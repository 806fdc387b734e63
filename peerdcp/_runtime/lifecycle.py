"""The lifetime every public class shares: ``check``, ``close``, the context manager, and refusal after a timeout.

A public class (``OutputReducer``, ``QueryGather``, ``IndexKCache``, ``TopK``) derives from :class:`Collective`
and sets, in its constructor, ``device`` and, where it has a direct path, ``_buf`` (its :class:`PeerBuffer`) and
``_err`` (its :class:`~peerdcp._runtime.device.ErrorWord`). Every call begins with ``self._ready("name")``.
"""

from __future__ import annotations

import torch

from ..errors import PeerTimeoutError


class Collective:
    """Base of the public classes: one object per rank of a group, created, called and closed on every rank.

    After a wait timed out (a peer missed a call), the object refuses every later call with the same
    :class:`PeerTimeoutError`: its peer memory holds a half-finished exchange, and reusing a slot whose
    peer may still write into it would give a wrong answer instead of an error.
    """

    device: torch.device
    _closed: bool = False
    _failure: PeerTimeoutError | None = None
    _err = None  # ErrorWord of the direct path (None: nothing of this object waits on a peer)
    _buf = None  # PeerBuffer of the direct path (None: no peer memory)

    # ---------------------------------------------------------------------------------- state
    def _timeout_error(self) -> PeerTimeoutError:
        """The error the set error word stands for (a class whose kernels encode the epoch differently
        overrides this)."""
        return self._err.error()

    def _ready(self, where: str) -> None:
        """Raise before a call: ``ValueError`` when closed, the recorded timeout, or a timeout the error word
        reports now (read without synchronizing: a call still on the GPU reports at a later call)."""
        if self._closed:
            raise ValueError(f"{type(self).__name__}.{where}: the object is closed")
        if self._failure is not None:
            raise self._failure
        if self._err is not None and self._err.words[0] != 0:
            self._failure = self._timeout_error()
            raise self._failure

    def check(self) -> None:
        """Raise :class:`PeerTimeoutError` if a wait of an earlier call timed out. Synchronizes the device first
        (outside CUDA-graph capture), so calls still in flight are included; once it raised, every call raises."""
        if not self._closed and self.device.type == "cuda" and not torch.cuda.is_current_stream_capturing():
            torch.cuda.synchronize(self.device)
        self._ready("check")

    # ------------------------------------------------------------------------------- lifetime
    def _release(self) -> None:
        """Drop what the object holds besides its peer buffer (called once, by :meth:`close`)."""

    def close(self) -> None:
        """Collective and idempotent: every rank calls it. Waits for this rank's kernels first (a kernel still
        storing into peer memory that is being unmapped would fault), then releases the peer memory."""
        if self._closed:
            return
        self._closed = True
        if self._buf is not None and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._release()
        buf, self._buf = self._buf, None
        if buf is not None:
            buf.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self):
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
