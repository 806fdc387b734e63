"""The CUDA C++ merge kernel (csrc/topk/merge.cu) alone, on one GPU: W sorted candidate lists (no peers) merged
into the exact top-k, for W = 1 ... 8, every CTAs-per-row count the rule can give and more, and list lengths
that leave lists empty, short, one short of k and full. Checked against ``torch.topk`` over the union."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.cuda


def _lists(W: int, T: int, n: int, k: int, gen: torch.Generator, scores: int = 1 << 31) -> torch.Tensor:
    """``[W, T, n]`` int64: each row sorted descending, unique keys >= 0 over all lists, a -1 tail of a random
    length per (list, row) drawn from the lengths that matter (0, 1, k - 1, k, anything). ``scores``: how many
    distinct score parts the keys draw from (3: most keys tie in score with keys of the other lists, and only
    their id parts order them)."""
    N = W * T * n  # canonical keys (score bits << 31 | 2^31 - 1 - id) with distinct ids: unique, every id once
    keys = (torch.randint(0, scores, (N,), generator=gen) << 31) | torch.randperm(N, generator=gen)
    keys = keys.view(W, T, n).sort(dim=2, descending=True).values
    choices = torch.tensor([0, 1, max(k - 1, 0), k, n])
    lens = torch.where(
        torch.rand(W, T, generator=gen) < 0.5,
        choices[torch.randint(0, len(choices), (W, T), generator=gen)],
        torch.randint(0, n + 1, (W, T), generator=gen),
    ).clamp(max=n)
    keys[torch.arange(n).view(1, 1, n) >= lens[..., None]] = -1
    return keys


def _expect(lists: torch.Tensor, k: int) -> torch.Tensor:
    W, T, n = lists.shape
    cand = lists.permute(1, 0, 2).reshape(T, W * n)
    top = torch.topk(cand, min(k, W * n), dim=1).values
    if top.shape[1] < k:
        top = torch.cat([top, torch.full((T, k - top.shape[1]), -1, dtype=top.dtype)], dim=1)
    return torch.where(top >= 0, 0x7FFFFFFF - (top & 0x7FFFFFFF), torch.full_like(top, -1)).to(torch.int32)


@pytest.mark.parametrize("W", [1, 2, 3, 4, 5, 8])
@pytest.mark.parametrize("k", [1, 7, 64, 2048])
def test_cuda_merge_matches_topk_for_every_cta_count(W, k):
    from dataclasses import replace

    from peerdcp.topk import ops
    from peerdcp.topk import policy as pol
    from peerdcp.topk.candidates import _merge_lists

    dev = torch.device("cuda", torch.cuda.current_device())
    # also opts the kernel in to the device's shared memory; every sm_90 GPU holds W = 8 lists of k = 2048
    assert ops.max_keys(dev.index) >= 8 * 2048
    gen = torch.Generator().manual_seed(1000 * W + k)
    # the rule: place-all at T = 1 (every W and k), the cut-off mode at T = 300; both also with 3 distinct scores
    for T, scores in ((1, 1 << 31), (5, 1 << 31), (70, 1 << 31), (300, 1 << 31), (1, 3), (300, 3)):
        lists = _lists(W, T, k, k, gen, scores)
        expect = _expect(lists, k)
        tunings = [{}]  # the rule
        tunings += [{"cuda_merge_ctas_per_row": c} for c in (1, 2, 3, 4, 8)]  # cut-off mode
        tunings += [{"cuda_merge_place_all_ctas": c} for c in (1, 3, 8, 32, 64)]  # place-all mode
        for tuning in tunings:
            out = torch.full((T, k), 12345, dtype=torch.int32, device=dev)  # poisoned
            p = replace(pol.DEFAULT_POLICY, **tuning)
            if tuning:
                ((field, n),) = tuning.items()
                assert pol.grid(T, W, k, dev.index, policy=p) == (n, "place" in field)
            elif T in (1, 300):
                assert pol.grid(T, W, k, dev.index, policy=p)[1] == (T == 1), (W, k, T)
            _merge_lists(out, lists.to(dev), W, k, "cuda", policy=p)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu(), expect), (W, k, T, scores, tuning)
