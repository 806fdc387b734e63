"""The Query sentinel push's word formats (``peerdcp.query.sentinel``, mirrored by ``csrc/query_common.cuh``'s
``sn_word`` / ``sn_word_bf16`` and ``csrc/query_lines.cuh``'s ``copy_rows_sn``): a producer's word is never the
rest state and keeps every non-NaN value bit for bit; a consumer takes an item only when every word of it
landed."""

from __future__ import annotations

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
