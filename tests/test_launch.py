"""RankPool: a call that times out or is interrupted while the ranks still run it leaves no stale results for the
next call."""

from __future__ import annotations

import signal
import time

import pytest

from peerdcp.harness.launch import RankError, RankPool


class _Interrupt(Exception):
    pass


def _raise(*_: object) -> None:
    raise _Interrupt


def _rank_of_pool() -> int:
    import torch.distributed as dist

    return dist.get_rank()


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs SIGALRM")
def test_interrupted_call_breaks_the_pool():
    """pytest-timeout's signal method raises inside ``run``'s wait, as this SIGALRM handler does: the pool must
    be marked broken (the conftest then builds a new one), not hand the sleeping call's results to the next."""
    pool = RankPool(2)
    assert pool.run(_rank_of_pool) == [0, 1]
    old = signal.signal(signal.SIGALRM, _raise)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.5)
        with pytest.raises(_Interrupt):
            pool.run(time.sleep, 3.0)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    assert pool.broken
    with pytest.raises(RankError, match="broken"):
        pool.run(_rank_of_pool)
    assert not any(p.is_alive() for p in pool._procs)  # closed: no rank left running the interrupted call
    with RankPool(2) as fresh:
        assert fresh.run(_rank_of_pool) == [0, 1]


def test_timed_out_call_breaks_the_pool():
    pool = RankPool(2)
    with pytest.raises(RankError, match=r"sleep: ranks \[0, 1\] did not finish within 0.5 s"):
        pool.run(time.sleep, 3.0, timeout=0.5)
    assert pool.broken
    with pytest.raises(RankError, match="broken"):
        pool.run(_rank_of_pool)
    assert not any(p.is_alive() for p in pool._procs)


def _threads() -> int:
    import torch

    return torch.get_num_threads()


@pytest.mark.parametrize("world", [2, 3])
def test_workers_share_the_cores(world, monkeypatch):
    """Each of W workers runs torch with cores // W threads (at least 1), so W processes do not oversubscribe
    the host; an explicit OMP_NUM_THREADS is left to torch."""
    import os

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with RankPool(world) as pool:
        assert pool.run(_threads) == [max(1, (os.cpu_count() or 1) // world)] * world
    with RankPool(world, env={"OMP_NUM_THREADS": "3"}) as pool:
        assert pool.run(_threads) == [3] * world
