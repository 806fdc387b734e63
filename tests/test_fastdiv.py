"""The CUDA kernels' division by a per-call divisor (``peerdcp::FastDiv`` in ``csrc/common.cuh``), on the host.

The Query and Output kernels divide item indices by the call's heads, items per unit, words per row and the like
with a multiply-high, an add and a shift instead of a hardware-less integer division. This checks the same formula,
in exact integer arithmetic, against ``//`` for every divisor the kernels can meet and for dividends at and around
every multiple of the divisor near both ends of the range [0, 2^31) plus random ones (the GPU byte-identity tests
run the kernels themselves). With nvcc present, the C++ ``FastDiv::make`` itself (through the Query library's
``peerdcp_fastdiv_make``) must produce the same multiplier and shift as the formula checked here.
"""

import ctypes
import random

import pytest


def _make(d: int) -> tuple[int, int]:
    d = max(d, 1)
    s = 0
    while (1 << s) < d:
        s += 1
    return ((1 << 32) * ((1 << s) - d)) // d + 1, s


def _div(x: int, m: int, s: int) -> int:
    # (umulhi(x, m) + x) >> s in uint32 arithmetic: the sum must not wrap for x < 2^31
    hi = (x * m) >> 32
    total = hi + x
    assert total < 1 << 32
    return total >> s


DIVISORS = sorted({*range(1, 300), 384, 512, 576, 1024, 1152, 4096, 65535, 65536, 1 << 20, (1 << 31) - 1})


@pytest.mark.parametrize("d", DIVISORS)
def test_fastdiv_matches_integer_division(d: int) -> None:
    m, s = _make(d)
    assert 0 < m < 1 << 32
    rng = random.Random(d)
    top = (1 << 31) - 1
    xs = {0, 1, top, top - 1, *range(min(d * 4, 4096))}
    for k in (1, 2, 3, 1000, top // d - 1, top // d):
        xs.update(x for x in (k * d - 1, k * d, k * d + 1) if 0 <= x <= top)
    xs.update(rng.randrange(top + 1) for _ in range(2000))
    for x in xs:
        assert _div(x, m, s) == x // d, (d, x)


def test_fastdiv_divisor_below_one_is_the_identity() -> None:
    # the host maps an unused divisor (< 1: no items to divide) to 1
    m, s = _make(0)
    assert all(_div(x, m, s) == x for x in (0, 1, 77, (1 << 31) - 1))


@pytest.mark.nvcc
def test_host_make_produces_the_checked_multipliers() -> None:
    from peerdcp.query import ops

    fn = ops.load().peerdcp_fastdiv_make
    fn.restype = None
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32)]
    m, s = ctypes.c_uint32(), ctypes.c_uint32()
    for d in (-5, 0, *DIVISORS):
        fn(d, ctypes.byref(m), ctypes.byref(s))
        assert (m.value, s.value) == _make(d), d
