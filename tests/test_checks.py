"""The argument helpers and errors every public class shares (``peerdcp._runtime.checks``, ``peerdcp.errors``,
``peerdcp._runtime.groups``)."""

from __future__ import annotations

import pickle

import pytest
import torch

from peerdcp._runtime.checks import MAX_TIMEOUT_S, resolve_device, timeout_problem
from peerdcp.errors import PeerSetupError, PeerTimeoutError


def test_peer_errors_survive_pickling():
    """A worker pool sends a rank's exception to its parent pickled; PeerTimeoutError's default reduction passed
    the message as its only argument and unpickling raised TypeError (a broken pool instead of the error)."""
    e = PeerTimeoutError(1, 0, "output", epoch=7, timeout_s=2.5)
    f = pickle.loads(pickle.dumps(e))
    assert type(f) is PeerTimeoutError and str(f) == str(e)
    assert (f.rank, f.peer, f.mechanism, f.epoch, f.timeout_s) == (1, 0, "output", 7, 2.5)
    g = pickle.loads(pickle.dumps(PeerSetupError("allocate failed on rank 1")))
    assert type(g) is PeerSetupError and str(g) == "allocate failed on rank 1"


@pytest.mark.parametrize(
    "value,ok",
    [(10.0, True), (1, True), (MAX_TIMEOUT_S, True), (0, False), (-1.0, False), (float("inf"), False),
     (float("nan"), False), (2 * MAX_TIMEOUT_S, False), (1e12, False), (True, False), ("10", False), (None, False)],
)  # fmt: skip
def test_timeout_bound(value, ok):
    assert (timeout_problem(value) is None) is ok, (value, timeout_problem(value))


def test_devices_that_do_not_exist_are_value_errors():
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    bad = [f"cuda:{n}", n, "meta", "not-a-device", -1]
    if not torch.cuda.is_available():
        bad += ["cuda", "cuda:0", 0]  # (an AssertionError from torch, or accepted, before)
    for dev in bad:
        with pytest.raises(ValueError):
            resolve_device(dev)
    assert resolve_device("cpu") == torch.device("cpu")


def test_a_cuda_launch_never_takes_a_stream_for_host_tensors():
    """``_runtime.device.current_stream_handle`` (every ctypes launch's stream) refuses a non-CUDA device: were it to
    return the current device's stream, a launch with host pointers would run (and fault the GPU)."""
    from peerdcp._runtime.device import current_stream_handle

    for dev in ("cpu", "meta"):
        with pytest.raises(ValueError, match="CUDA device"):
            current_stream_handle(torch.device(dev))
