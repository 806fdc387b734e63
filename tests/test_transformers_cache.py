"""ShardedLatentCache: each rank keeps exactly its owned columns; the reported length is global."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from peerdcp.integrations.transformers.cache import ShardedLatentCache  # noqa: E402
from peerdcp.topk import reference as ref  # noqa: E402


@pytest.mark.parametrize("W,I", [(2, 1), (3, 1), (2, 2), (3, 4)])
def test_ranks_partition_the_columns_and_report_the_global_length(W, I):
    torch.manual_seed(W * 10 + I)
    B, C, R = 2, 8, 4
    chunks = [13, 1, 1, 5, 1]  # a prefill not a multiple of W*I, then decode steps
    total = sum(chunks)
    c_all = torch.randn(B, total, C)
    pe_all = torch.randn(B, total, R)
    caches = [ShardedLatentCache(2, r, W, I) for r in range(W)]
    start = 0
    for S in chunks:
        for r, cache in enumerate(caches):
            c, pe = cache.update(c_all[:, start : start + S], pe_all[:, start : start + S], 1)
            assert cache.get_seq_length(1) == start + S
            assert cache.get_mask_sizes(1, 1) == (start + S + 1, 0)
            g = cache.layers[1].local_columns()
            assert torch.equal(ref.owner(g, W, I), torch.full_like(g, r))
            assert torch.equal(ref.local_row(g, W, I), torch.arange(g.numel()))
            assert torch.equal(c, c_all[:, g]) and torch.equal(pe, pe_all[:, g])
        start += S
    owned = torch.cat([cache.layers[1].local_columns() for cache in caches]).sort().values
    assert torch.equal(owned, torch.arange(total))
    assert sum(cache.bytes_local() for cache in caches) == c_all.numel() * 4 + pe_all.numel() * 4
    assert caches[0].get_seq_length(0) == 0  # layer 0 was never written


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="rank"):
        ShardedLatentCache(2, 2, 2)
    with pytest.raises(ValueError, match="num_layers"):
        ShardedLatentCache(0, 0, 2)
    cache = ShardedLatentCache(1, 0, 2)
    with pytest.raises(ValueError, match="c_kv"):
        cache.update(torch.zeros(1, 2, 3), torch.zeros(1, 3, 2), 0)
