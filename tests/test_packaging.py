"""What a plain ``pip install peerdcp`` (a wheel, not an editable checkout) carries: the CUDA C++ sources that
``peerdcp._runtime.jit`` builds at first use. They sit in the checkout's top-level ``csrc/`` (DESIGN.md section 2), so
``setup.py`` copies them into the wheel as ``peerdcp/csrc/``; without them an installed peerdcp could build none of
its kernels and every CUDA fast path would fall back to Triton."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from peerdcp._runtime import jit

REPO = Path(__file__).resolve().parents[1]


def _build_wheel(tmp_path: Path) -> Path:
    # from a copy of what the wheel is made of, so that setuptools' build/ folder never lands in the tree
    src = tmp_path / "src"
    src.mkdir()
    for f in ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md"):
        shutil.copy(REPO / f, src / f)
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.o")
    shutil.copytree(REPO / "peerdcp", src / "peerdcp", ignore=ignore)
    shutil.copytree(REPO / "csrc", src / "csrc", ignore=ignore)
    out = tmp_path / "wheel"
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    (whl,) = out.glob("peerdcp-*.whl")
    return whl


def test_checkout_builds_from_its_csrc():
    assert jit.CSRC == REPO / "csrc"
    for name, (sources, _) in jit.LIBRARIES.items():
        for s in sources:
            assert (jit.CSRC / s).is_file(), (name, s)


def test_installed_wheel_finds_every_source_and_keys_the_same_builds(tmp_path):
    whl = _build_wheel(tmp_path)
    names = set(zipfile.ZipFile(whl).namelist())
    sources = [p for p in jit.CSRC.rglob("*") if p.suffix in (".cu", ".cuh")]
    want = {f"peerdcp/csrc/{p.relative_to(jit.CSRC).as_posix()}" for p in sources}
    assert len(want) >= sum(len(s) for s, _ in jit.LIBRARIES.values())
    assert want <= names, sorted(want - names)
    # the unpacked wheel's jit module (it imports nothing of the package): it finds the sources in the package, and
    # every library gets the checkout's cache key (same sources and headers, same flags)
    site = tmp_path / "site"
    zipfile.ZipFile(whl).extractall(site)
    spec = importlib.util.spec_from_file_location("wheel_jit", site / "peerdcp" / "_runtime" / "jit.py")
    wheel_jit = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(wheel_jit)
    assert site / "peerdcp" / "csrc" == wheel_jit.CSRC
    for n, (s, f) in jit.LIBRARIES.items():
        assert wheel_jit._target(n, s, f)[1].name == jit._target(n, s, f)[1].name, n


def test_missing_sources_are_a_clear_jit_error(tmp_path, monkeypatch):
    monkeypatch.setattr(jit, "CSRC", tmp_path)
    sources, flags = jit.LIBRARIES["peerdcp_output"]
    with pytest.raises(jit.JitError, match="sources are missing"):
        jit._target("peerdcp_output", sources, flags)
