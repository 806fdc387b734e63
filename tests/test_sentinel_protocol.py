"""The sentinel kernel's word formats (``peerdcp.output.sentinel``, mirrored by ``csrc/output/sentinel.cuh``):
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

    out = S.off_sentinel(S.SENTINEL_WORD)  # what a producer stores for two sentinel-pattern NaNs
    halves = [out & 0xFFFF, out >> 16, 0xFFFF]  # ... and the rest pattern itself
    bits = torch.tensor([h - 0x10000 if h >= 0x8000 else h for h in halves], dtype=torch.int16)
    for dtype in (torch.bfloat16, torch.float16):
        assert bool(torch.isnan(bits.view(dtype)).all())


@given(st.lists(u32, min_size=4, max_size=4), st.lists(st.booleans(), min_size=4, max_size=4))
def test_a_vector_is_taken_only_when_every_word_landed(words, landed):
    seen = tuple(S.off_sentinel(w) if ok else S.SENTINEL_WORD for w, ok in zip(words, landed))
    assert S.vector_arrived(seen) == all(landed)


@settings(max_examples=500)
@given(
    st.integers(1, 2**40),
    st.integers(1, 2**20 - 1),
    u32,
    st.one_of(st.none(), st.tuples(st.sampled_from([2, 4, 4096, 8192, 4096 * 3 + 2, 24690]), st.booleans(), u32)),
    st.integers(1, 2**20 - 1),
    st.booleans(),
    st.booleans(),
)
def test_an_lse_is_taken_only_when_it_is_this_calls(epoch, tokens, lse, last, other_T, a_new, b_new):
    """Each of the consumer's two words shows either the row's last earlier write - any number of calls back,
    e.g. exactly 4096*m with the same T, or fresh zeros if there was none - or this call's: no older version, as
    the consumer observed that write's two words when it consumed the row (coherence keeps later reads at or after
    it), and the pair is one 16-byte store (each word atomic, the pair not). Whatever it takes is this call's LSE."""
    fv = S.flag_value(epoch, tokens)
    old = (0, 0)
    if last is not None and last[0] < epoch:
        back, same_T, lse_old = last
        old = S.lse_words(S.flag_value(epoch - back, tokens if same_T else other_T), lse_old)
    new = S.lse_words(fv, lse)
    got = S.take_lse(new[0] if a_new else old[0], new[1] if b_new else old[1], fv)
    assert got is None or got == lse
    assert (got is not None) == (a_new and b_new) or old[0] & 0xFFFFFFFF == lse  # a torn pair only with equal LSEs


def test_a_32_bit_flag_would_take_a_word_4096_calls_old():
    """Why the flag has 64 bits: the low half alone repeats every 2**12 calls for the same T."""
    epoch, tokens = 10_000, 256
    old = S.lse_words(S.flag_value(epoch - 4096, tokens), 0x3F800000)
    new_fv = S.flag_value(epoch, tokens)
    assert old[0] >> 32 == new_fv & 0xFFFFFFFF  # the low halves coincide...
    assert S.take_lse(old[0], old[1], new_fv) is None  # ...the high halves do not
    assert S.take_lse(old[0], S.lse_words(new_fv, 0x40000000)[1], new_fv) is None  # a torn pair: LSEs differ
