"""``python -m peerdcp.cli`` behaves like ``python -m peerdcp``; on CPU the main job's report labels its
times as interpreter times and prints no speed-up."""

from __future__ import annotations

import json
import subprocess
import sys

from peerdcp.harness import run


def test_cli_module_runs_like_package():
    a = subprocess.run([sys.executable, "-m", "peerdcp.cli", "probe", "--json"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    b = subprocess.run([sys.executable, "-m", "peerdcp", "probe", "--json"], capture_output=True, text=True,
                       timeout=120)  # fmt: skip
    assert a.returncode == b.returncode == 0, a.stderr
    assert a.stdout.strip(), "python -m peerdcp.cli printed nothing"
    assert json.loads(a.stdout).keys() == json.loads(b.stdout).keys()


def _report(interpreted: bool) -> dict:
    g = {"name": "tiny", "heads": 4, "nope_dim": 8, "rope_dim": 4, "index_heads": 0, "index_dim": 0, "topk": 0}
    check = {"ok": True, "query_ok": True, "merge_outside": 0, "output_rel_err": 0.0}
    return {"geometry": g, "where": "here", "rows": 2, "context": 8, "seconds": 0.1, "ok": True,
            "interpreted": interpreted, "objects": [{}], "check": [check], "capacity": [],
            "timings": [{"output": {"peerdcp_us": 1000.0, "baseline_us": 250.0}}]}  # fmt: skip


def test_cpu_report_labels_interpreter_times_without_speedup(capsys):
    run._print_report(_report(interpreted=True))
    out = capsys.readouterr().out
    assert "speed-up" not in out and "0.25x" not in out
    assert "interpreter" in out and "measures nothing" in out


def test_gpu_report_keeps_speedup(capsys):
    run._print_report(_report(interpreted=False))
    out = capsys.readouterr().out
    assert "speed-up" in out and "0.25x" in out
