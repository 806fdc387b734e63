"""The Query sentinel push's word formats (``peerdcp.query.sentinel``, mirrored by ``csrc/query/params.cuh``'s
``sn_word`` / ``sn_word_bf16`` and ``csrc/query/flag_in_data.cuh``'s ``copy_rows_sn``): a producer's word is never the
rest state and keeps every non-NaN value bit for bit; a consumer takes an item only when every word of it
landed. And its slot-reuse argument on a model of W = 2..4 ranks under arbitrary interleavings: two parity
areas never hand a consumer another call's word nor lose one (one area would) - the CUDA kernel itself has
only run at W = 2."""

from __future__ import annotations

import random

import torch
from hypothesis import given
from hypothesis import strategies as st

from peerdcp.query import sentinel as S

u64 = st.integers(0, S.REST)


def _fp8(codes: list[int]) -> torch.Tensor:
    return torch.tensor(codes, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _bf16(halves: list[int]) -> torch.Tensor:
    return torch.tensor([h - 0x10000 if h >= 0x8000 else h for h in halves], dtype=torch.int16).view(torch.bfloat16)


@given(u64)
def test_an_fp8_word_is_never_at_rest_and_changes_only_if_it_was(w):
    out = S.fp8_word(w)
    assert out != S.REST
    assert out == w or w == S.REST


def test_the_rewritten_fp8_word_is_still_eight_nans():
    codes = [(S.fp8_word(S.REST) >> (8 * i)) & 0xFF for i in range(8)]
    assert codes == [0xFF] * 7 + [0x7F]
    assert bool(torch.isnan(_fp8(codes)).all())


@given(u64)
def test_a_bf16_word_is_never_at_rest_and_only_its_rest_halves_change(w):
    out = S.bf16_word(w)
    assert out != S.REST
    for i in range(4):
        before, after = (w >> (16 * i)) & 0xFFFF, (out >> (16 * i)) & 0xFFFF
        assert after == (0x7FC0 if before == 0xFFFF else before)


def test_the_rewritten_bf16_half_is_a_nan():
    assert bool(torch.isnan(_bf16([0xFFFF, 0x7FC0])).all())


@given(st.lists(u64, min_size=1, max_size=2), st.lists(st.booleans(), min_size=2, max_size=2), st.booleans())
def test_an_item_is_taken_only_when_every_word_landed(words, landed, bf16):
    publish = S.bf16_word if bf16 else S.fp8_word
    seen = tuple(publish(w) if ok else S.REST for w, ok in zip(words, landed))
    assert S.taken(seen) == all(landed[: len(words)])


# ------------------------------------------------------------------------------------------------ schedules
# The sentinel push's slot-reuse argument (csrc/query/flag_in_data.cuh), checked on a model under arbitrary
# interleavings: W ranks run `calls` calls each, in stream order. A call publishes one word into its parity
# area of every peer (the stores are in flight until they land, and all of them land before the call can
# complete - a kernel's stores are performed when it completes); it then takes every peer's word from its own
# area of that parity once it is not at rest - it must be this call's - and restores the rest state; once it
# has every peer's word and its own stores landed, the call completes and the next may start.


def _run_schedule(world: int, calls: int, parities: int, choices: list[int]) -> str | None:
    """None if every rank finished every call having taken only its own call's words, else what went wrong.
    ``choices`` pick among the enabled actions step by step (then the first enabled one, until done)."""
    rest = -1
    area = {(d, s, k): rest for d in range(world) for s in range(world) for k in range(parities)}
    call = [0] * world
    published = [False] * world
    taken = [set() for _ in range(world)]
    flight: list[tuple[int, int, int, int]] = []  # (dest, source, parity, value) not landed yet
    step = 0
    while True:
        actions = []
        for r in range(world):
            if call[r] == calls:
                continue
            if not published[r]:
                actions.append(("publish", r, None))
                continue
            k = call[r] % parities
            for s in range(world):
                if s != r and s not in taken[r] and area[(r, s, k)] != rest:
                    actions.append(("take", r, s))
            own_in_flight = any(f[1] == r for f in flight)
            if len(taken[r]) == world - 1 and not own_in_flight:
                actions.append(("complete", r, None))
        actions += [("land", i, None) for i in range(len(flight))]
        if not actions:
            return None if all(c == calls for c in call) else f"deadlock at calls {call}"
        pick = choices[step] % len(actions) if step < len(choices) else 0
        step += 1
        kind, r, s = actions[pick]
        if kind == "publish":
            flight += [(d, r, call[r] % parities, call[r]) for d in range(world) if d != r]
            published[r] = True
        elif kind == "land":
            d, src, k, v = flight.pop(r)
            area[(d, src, k)] = v
        elif kind == "take":
            k = call[r] % parities
            if area[(r, s, k)] != call[r]:
                return f"rank {r} call {call[r]} took word {area[(r, s, k)]} from rank {s}"
            area[(r, s, k)] = rest
            taken[r].add(s)
        else:
            call[r] += 1
            published[r] = False
            taken[r] = set()


@given(st.integers(2, 4), st.lists(st.integers(0, 1 << 16), max_size=400))
def test_two_parity_areas_never_give_a_stale_word_or_lose_one(world, choices):
    assert _run_schedule(world, 5, 2, choices) is None


def test_one_area_would_not_be_enough():
    # the model can fail: with one area a fast producer's next word lands before the consumer took this one
    rnd = random.Random(11)
    bad = [_run_schedule(2, 3, 1, [rnd.randrange(1 << 16) for _ in range(200)]) for _ in range(200)]
    assert any(b is not None and "took word" in b for b in bad)
