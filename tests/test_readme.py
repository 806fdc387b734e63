"""The README's examples run as written, on 2 CPU rank processes over host memory (Triton interpreter).

A README example is a fenced ```python block whose line before the fence is exactly ``<!-- example -->``.
Every such block is run with ``exec`` on both ranks of one process group (default group initialized, gloo),
in a fresh namespace; the examples check their own results against the references with ``assert``, so a
wrong result fails like an exception does.
"""

from __future__ import annotations

import re
import traceback
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
MARK = "<!-- example -->"
_BLOCK = re.compile(r"^" + re.escape(MARK) + r"\n```python\n(.*?)\n```", re.S | re.M)


def examples(text: str) -> list[str]:
    """The source of every marked ```python block of ``text``, in order."""
    return _BLOCK.findall(text)


def run_block(source: str) -> str | None:
    """Run on every rank: ``exec`` one example; None if it ran, else the traceback."""
    try:
        exec(compile(source, "<README example>", "exec"), {"__name__": "__readme__"})
    except BaseException:  # noqa: BLE001 - the traceback is the result
        return traceback.format_exc()
    return None


def test_readme_has_examples():
    blocks = examples(README.read_text())
    assert len(blocks) >= 3, "README examples missing or unmarked"
    assert MARK in README.read_text()


@pytest.mark.parametrize("index", range(len(examples(README.read_text()))))
def test_readme_example_runs_on_two_ranks(pools, index):
    source = examples(README.read_text())[index]
    errors = pools(2).run(run_block, source)
    assert errors == [None, None], "\n".join(e for e in errors if e)


def test_broken_example_fails(pools):
    text = f"{MARK}\n```python\nimport torch.distributed as dist\nassert dist.get_world_size() == 3\n```\n"
    broken = "import torch.distributed as dist\nraise ValueError(f'broken on rank {dist.get_rank()}')"
    text += f"{MARK}\n```python\n{broken}\n```\n"
    blocks = examples(text)
    assert len(blocks) == 2
    for source, want in zip(blocks, ("AssertionError", "ValueError: broken on rank")):
        errors = pools(2).run(run_block, source)
        assert all(e is not None and want in e for e in errors), errors
