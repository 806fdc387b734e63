"""Packaging hook (the metadata is in pyproject.toml): a wheel carries the CUDA C++ sources of the top-level
``csrc/`` (DESIGN.md section 2) inside the package, as ``peerdcp/csrc/``, where ``peerdcp._runtime.jit`` looks first, so
an installed peerdcp can build its kernels at first use. An editable checkout builds from ``csrc/`` itself."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

CSRC = Path(__file__).resolve().parent / "csrc"


class BuildPyWithCsrc(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the package maps to the checkout, whose jit finds csrc/ beside it
        dst = Path(self.build_lib) / "peerdcp" / "csrc"
        self.mkpath(str(dst))
        for f in sorted(CSRC.rglob("*")):
            if f.suffix in (".cu", ".cuh"):
                rel = f.relative_to(CSRC)
                self.mkpath(str((dst / rel).parent))
                self.copy_file(str(f), str(dst / rel))


setup(cmdclass={"build_py": BuildPyWithCsrc})
