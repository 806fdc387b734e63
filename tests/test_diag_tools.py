"""The diagnosis scripts under ``scripts/diag/`` still match the tree they diagnose: a file move or a rewritten line
would otherwise surface only when someone runs them on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from scripts.diag import mutants, select_phases  # noqa: E402


@pytest.mark.parametrize("m", mutants.MUTANTS, ids=lambda m: m.name)
def test_every_mutant_applies_and_names_existing_tests(m):
    """Each mutant's text occurs exactly once in its file (what ``mutants.py`` requires before it runs anything),
    and the tests said to kill it exist."""
    path = REPO / m.path
    assert path.is_file(), m.path
    assert path.read_text().count(m.old) == 1, f"{m.name}: {m.path} holds the text to replace not exactly once"
    for t in m.tests:
        assert (REPO / t.split("::")[0]).is_file(), t


@pytest.mark.parametrize("kind", ["normal", "sink1e4", "sink-1e30", "lognormal", "cauchy"])
def test_select_phases_score_distributions(kind):
    """The distributions the GPU speed guard (``test_gpu_select_estimate_ignores_one_far_outlier``) asks for."""
    x = select_phases.scores(kind, 2, 256, torch.Generator().manual_seed(0), torch.device("cpu"))
    assert x.shape == (2, 256) and x.dtype == torch.float32 and bool(torch.isfinite(x).all())
    if kind.startswith("sink"):
        assert bool((x[:, 0] == float(kind[4:])).all()) and bool((x[:, 1:].abs() < 10).all())
