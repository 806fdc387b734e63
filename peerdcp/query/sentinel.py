"""The word formats of the Query sentinel push (``csrc/query/flag_in_data.cuh``, ``query/params.cuh``), as plain Python:
the spec the CUDA publish and poll rules implement, small enough to check exhaustively on the host
(``tests/test_query_sentinel.py``).

* The sentinel area holds ``REST`` (all 64 bits set) in every 8-byte word at rest.
* FP8 rows: a producer's word is eight e4m3 codes; the conversion (``cvt.rn.satfinite``) sends NaN to the
  canonical code 0x7F and never produces 0xFF, so a word equal to ``REST`` cannot occur - if it did, it would
  be sent with its top code 0x7F (:func:`fp8_word`; both codes are NaN).
* BF16 rows: a producer's word is four bf16 values, and the nope part passes the input's bits through, so a
  half 0xFFFF (a NaN) can occur; every such half is sent as the canonical NaN 0x7FC0 (:func:`bf16_word`), the
  one case where a sentinel-push call's bytes differ from the other exchanges'.
* A consumer takes an item (one word, or a pair read by one 16-byte load, each word single-copy atomic but not
  the pair) once no word of it equals ``REST`` (:func:`taken`), copies it and stores ``REST`` back.
"""

from __future__ import annotations

__all__ = ["REST", "fp8_word", "bf16_word", "taken"]

REST = (1 << 64) - 1
_BF16_REST, _BF16_NAN = 0xFFFF, 0x7FC0


def fp8_word(word: int) -> int:
    """A producer's 64-bit word of eight FP8 codes (code 0 in the low byte) as stored."""
    return REST >> 1 if word == REST else word


def bf16_word(word: int) -> int:
    """A producer's 64-bit word of four bf16 values (value 0 in the low half) as stored: 0xFFFF halves -> 0x7FC0."""
    halves = [(word >> (16 * i)) & 0xFFFF for i in range(4)]
    return sum((_BF16_NAN if h == _BF16_REST else h) << (16 * i) for i, h in enumerate(halves))


def taken(words: tuple[int, ...]) -> bool:
    """A consumer's arrival test of one item read as 64-bit words: none of them is at rest."""
    return all(w != REST for w in words)
