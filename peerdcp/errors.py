"""Exceptions raised by peerdcp.

Every setup failure is raised on *every* rank of the group (agree first, then act), so a caller can
catch it and fall back to a collective without the group diverging.
"""

from __future__ import annotations

__all__ = ["PeerDCPError", "PeerSetupError", "PeerTimeoutError", "MECHANISMS"]

# Codes written into a mechanism's device-side error word; index = code - 1.
MECHANISMS = ("output", "query", "topk", "signal-test")


class PeerDCPError(RuntimeError):
    """Base class of peerdcp's runtime errors."""


class PeerSetupError(PeerDCPError):
    """A collective setup step (allocation, rendezvous, agreement) failed on at least one rank.

    Raised on every rank with the failing ranks' messages, after partial state was rolled back.
    """


class PeerTimeoutError(PeerDCPError):
    """A bounded wait for a peer's signal expired.

    Attributes:
        rank: the rank (in the group) that waited.
        peer: the rank whose signal never arrived (-1: not known - a collective backend's call that did not
            complete in time names no rank).
        mechanism: which exchange waited ("output", "query", "topk", ...).
        epoch: the device epoch of the call that timed out (-1 if unknown).
        timeout_s: the bound that expired, in seconds (None if unknown).
    """

    def __init__(self, rank: int, peer: int, mechanism: str, epoch: int = -1, timeout_s: float | None = None):
        self.rank, self.peer, self.mechanism, self.epoch, self.timeout_s = rank, peer, mechanism, epoch, timeout_s
        wait = f" within {timeout_s:g} s" if timeout_s is not None else ""
        if peer >= 0:
            what = f"waited for peer {peer}{wait} and it never signalled (epoch {epoch})"
        else:
            what = f"started a collective that did not complete{wait} (a peer never joined it)"
        super().__init__(f"peerdcp {mechanism}: rank {rank} {what}; the object is now unusable and must be re-created")

    def __reduce__(self):
        # (the default pickles the message as the only argument: unpickling then failed with a TypeError, and a
        # worker pool reported a broken pool instead of this error)
        return type(self), (self.rank, self.peer, self.mechanism, self.epoch, self.timeout_s)
