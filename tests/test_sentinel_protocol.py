"""The sentinel kernel's word formats (``peerdcp.output.sentinel``, mirrored by ``csrc/output_sentinel.cuh``):
a producer's word never looks like rest, a consumer never takes a vector or an LSE that is not this call's -
whatever mix of old and new words it reads, including words left over from a call exactly 2**12 calls earlier
(where a 32-bit flag would repeat)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from peerdcp.output import sentinel as S

u32 = st.integers(0, 2**32 - 1)


@given(u32)
def test_a_published_word_is_never_the_rest_state(w):
    out = S.off_sentinel(w)
    assert S.vector_arrived((out,))
    for shift in (0, 16):
        half, got = (w >> shift) & 0xFFFF, (out >> shift) & 0xFFFF
        assert got == (0x7FC0 if half == 0xFFFF else half)  # only the sentinel half changes, to another NaN


def test_the_rewritten_half_is_a_nan_in_bf16_and_fp16():
    import torch

    bits = torch.tensor([0x7FC0, 0xFFFF - 0x10000], dtype=torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        assert bool(torch.isnan(bits.view(dtype)).all())


@given(st.lists(u32, min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_a_vector_is_taken_only_when_every_word_landed(words, landed):
    seen = tuple(S.off_sentinel(w) if ok else S.SENTINEL_WORD for w, ok in zip(words, landed))
    assert S.vector_arrived(seen) == all(landed)


calls = st.lists(st.tuples(st.integers(1, 2**20 - 1), u32), min_size=1, max_size=6)  # (T, lse bits) per write


@settings(max_examples=300)
@given(st.integers(1, 2**40), st.integers(1, 2**20 - 1), u32, calls, st.data())
def test_an_lse_is_taken_only_when_it_is_this_calls(epoch, tokens, lse, history, data):
    """The row's earlier writes (any epochs, some exactly 4096*m calls back with the same T) and the current one;
    the consumer's two words each come from any of them (or fresh zeros): whatever it takes is this call's LSE."""
    fv = S.flag_value(epoch, tokens)
    older = []
    for T_old, lse_old in history:
        back = data.draw(st.sampled_from([2, 4, 4096, 8192, 4096 * 3 + 2, 12345 * 2]))
        if back < epoch:
            older.append(S.lse_words(S.flag_value(epoch - back, data.draw(st.sampled_from([T_old, tokens]))), lse_old))
    new = S.lse_words(fv, lse)
    versions = [(0, 0), *older, new]
    a = data.draw(st.sampled_from(versions))[0]
    b = data.draw(st.sampled_from(versions))[1]
    got = S.take_lse(a, b, fv)
    assert got is None or got == lse
    assert S.take_lse(*new, fv) == lse  # both words of this call: taken


def test_a_32_bit_flag_would_take_a_word_4096_calls_old():
    """Why the flag has 64 bits: the low half alone repeats every 2**12 calls for the same T."""
    epoch, tokens = 10_000, 256
    old = S.lse_words(S.flag_value(epoch - 4096, tokens), 0x3F800000)
    new_fv = S.flag_value(epoch, tokens)
    assert old[0] >> 32 == new_fv & 0xFFFFFFFF  # the low halves coincide...
    assert S.take_lse(old[0], old[1], new_fv) is None  # ...the high halves do not
    assert S.take_lse(old[0], S.lse_words(new_fv, 0x40000000)[1], new_fv) is None  # a torn pair: LSEs differ
