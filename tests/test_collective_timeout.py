"""The collective backends on CPU tensors (gloo) bound a missing peer by ``timeout_s`` as the direct ones do:
Output a2a / ag_rs, Query allgather, Top-K allgather (``peerdcp._runtime.groups.bounded_collective``)."""

from __future__ import annotations

import pytest
from on_ranks import collective as fns

KINDS = ["output-a2a", "output-ag_rs", "query", "topk"]
TIMEOUT = 1.5


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("world,absent", [(2, 1), (3, 0)])
def test_missing_peer_raises_timeout_not_torch_wait(pools, kind, world, absent):
    res = pools(world).run(fns.missing_peer, kind, absent, TIMEOUT)
    mech = kind.split("-")[0]
    for r, d in enumerate(res):
        assert d["good"] == "no error", d
        assert d["backend"] in ("a2a", "ag_rs", "allgather"), d
        if r == absent:
            if kind != "output-ag_rs":  # the late call meets the others' pending collective, which completes it
                assert d["late"] == "no error" and d["late_dt"] < TIMEOUT, d
            continue
        assert d["first"] == f"rank={r} peer=-1 mech={mech}", d
        assert "collective that did not complete within 1.5 s" in d["message"], d
        assert 0.9 * TIMEOUT < d["dt"] < 3 * TIMEOUT, d  # the bound, not the group's 60 s
        assert d["second"] == d["first"] and d["second_dt"] < 0.5, d  # refused at once, no collective started


@pytest.mark.parametrize("kind", ["output-a2a", "query"])
def test_peer_gone_raises_torch_error_at_once(pools, kind):
    """A peer that left (its process died: connections closed) is torch's error, raised at once; the bound is for
    a peer that is alive but absent."""
    res = pools(2).run(fns.missing_peer, kind, 1, 30.0, gone=True)
    d = res[0]
    assert d["good"] == "no error", d
    assert "PeerTimeoutError" not in d["first"] and "Connection closed" in d["first"], d
    assert d["dt"] < 10.0, d
