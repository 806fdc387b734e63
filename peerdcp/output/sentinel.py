"""The word formats of the CUDA sentinel kernel (``csrc/output/sentinel.cuh``), as plain Python: the spec the
kernel's publish and poll rules implement, small enough to check exhaustively on the host
(``tests/test_sentinel_protocol.py``).

* Payload: the inbox holds ``0xFFFF`` in every 16-bit element at rest. A producer rewrites each ``0xFFFF``
  element of its 32-bit words to ``0x7FC0`` (both are NaN in bf16 and fp16) before storing, so a consumer that
  reads a vector as 32-bit words (each single-copy atomic) takes it once no word holds a ``0xFFFF`` half.
* LSE: the 64-bit flag ``fv = epoch * 2**20 + T`` travels in two 64-bit words ``(flag low half << 32 | lse bits,
  flag high half << 32 | lse bits)``; a consumer takes the LSE once both halves match this call's ``fv`` and
  both words hold the same LSE bits. Each word shows either the row's last earlier write - which may be any
  number of calls old, as a row past a small call's T keeps its words, and which the consumer observed when it
  consumed that row, so nothing older comes back - or this call's; the two may differ (each word is atomic, the
  16-byte pair is not).
"""

from __future__ import annotations

__all__ = ["SENTINEL_WORD", "off_sentinel", "vector_arrived", "lse_words", "take_lse", "flag_value"]

from .kernels import TOKEN_SPACE

SENTINEL_WORD = 0xFFFFFFFF  # two 16-bit sentinels: a 32-bit payload word at rest
_M32 = 0xFFFFFFFF


def flag_value(epoch: int, tokens: int) -> int:
    """The call's 64-bit flag (the plain kernel's): ``epoch * TOKEN_SPACE + T``, with ``1 <= T < TOKEN_SPACE``."""
    return epoch * TOKEN_SPACE + tokens


def off_sentinel(word: int) -> int:
    """A producer's 32-bit payload word as stored: each 16-bit half equal to ``0xFFFF`` becomes ``0x7FC0``."""
    lo, hi = word & 0xFFFF, (word >> 16) & 0xFFFF
    return ((0x7FC0 if hi == 0xFFFF else hi) << 16) | (0x7FC0 if lo == 0xFFFF else lo)


def vector_arrived(words: tuple[int, ...]) -> bool:
    """A consumer's arrival test of a vector read as 32-bit words: no word holds a ``0xFFFF`` half."""
    return all((w & 0xFFFF) != 0xFFFF and (w >> 16) & 0xFFFF != 0xFFFF for w in words)


def lse_words(fv: int, lse_bits: int) -> tuple[int, int]:
    """The two 64-bit LSE words a producer stores for flag ``fv`` and the LSE's fp32 bits."""
    return ((fv & _M32) << 32) | lse_bits, ((fv >> 32) << 32) | lse_bits


def take_lse(a: int, b: int, fv: int) -> int | None:
    """A consumer's rule for the words it read: the LSE bits once they are this call's, else None (poll on)."""
    if a >> 32 == fv & _M32 and b >> 32 == (fv >> 32) & _M32 and a & _M32 == b & _M32:
        return a & _M32
    return None
