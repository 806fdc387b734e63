"""The benchmarks' report logic (CPU): the Output issue's targets are judged on the default configuration,
never on whichever opt-in variant happened to be fastest at one T; every result file is standard JSON."""

from __future__ import annotations

from bench import output as O


def _row(method: str, T: int, median: float, ok: bool = True) -> dict:
    return dict(geometry="kimi", heads=16, T=T, method=method, mode="graph", ok=ok, median=median)


def test_verdict_uses_the_default_configuration():
    rows = [
        _row("sgl-a2a", 1, 10.0),
        _row("sgl-a2a", 128, 30.0),
        _row(O.DEFAULT_METHOD, 1, 5.0),  # 2.0x, misses 4.5 us
        _row(O.DEFAULT_METHOD, 128, 9.0),  # 3.33x, meets 10 us
        _row("direct-vmm-cuda_ll128", 1, 3.0),  # opt-in, faster: must not decide the verdict
        _row("direct-vmm-cuda_ll128", 128, 8.0),
    ]
    O._ratios(rows)
    v = O._verdict(rows)
    assert v[0].startswith(f"target T=1: {O.DEFAULT_METHOD} 5.00") and "NOT MET" in v[0], v
    assert "fastest variant direct-vmm-cuda_ll128 3.00" in v[0], v
    assert v[1].startswith(f"target T=128: {O.DEFAULT_METHOD} 9.00") and ": MET" in v[1], v
    assert "worst 2.00x at T=1: NOT MET" in v[2], v
    table = O._table(rows, "graph")
    assert "default x vs sgl-a2a" in table and "fastest variant" in table


def test_verdict_ignores_failed_rows():
    rows = [_row("sgl-a2a", 1, 10.0), _row(O.DEFAULT_METHOD, 1, 1.0, ok=False), _row("direct-vmm-cuda_ll", 1, 4.0)]
    O._ratios(rows)
    v = O._verdict(rows)
    assert not any(line.startswith("target T=1") for line in v), v  # no verdict from a wrong result


def test_write_json_is_standard_json(tmp_path):
    import json
    import math

    from bench.common import write_json

    bad = {"a": math.nan, "b": [1.5, math.inf], "c": {"d": (2, -math.inf)}, "e": "ok"}
    text = write_json(tmp_path / "x.json", bad).read_text()

    def reject(c: str):
        raise AssertionError(f"non-standard JSON constant {c}")

    assert json.loads(text, parse_constant=reject) == {"a": None, "b": [1.5, None], "c": {"d": [2, None]}, "e": "ok"}
