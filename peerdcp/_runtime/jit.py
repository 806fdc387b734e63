"""Build the CUDA C++ kernels in ``csrc/`` at first use, with ninja + nvcc, and load them with ctypes.

Each kernel file exposes a plain C ABI (``extern "C" int peerdcp_<op>(..., cudaStream_t)`` returning a
``cudaError_t``), so the build does not depend on torch's C++ ABI and takes seconds. The Python side
registers each entry point as a ``torch.library`` custom op with a fake implementation (see the
mechanisms' ``ops.py``) and launches it on the current stream, so it is CUDA-graph capturable.

Builds are cached under ``$PEERDCP_CACHE`` (default ``~/.cache/peerdcp``), keyed by the hash of the
sources and flags, and guarded by a file lock so W ranks starting together build once.
``PEERDCP_NO_JIT=1`` forbids compiling (a missing build then raises); ``PEERDCP_JIT_HOST_CHECK=1`` builds for
host entry points only (:func:`host_check`).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import hashlib
import os
import re
import shutil
import subprocess
from pathlib import Path

__all__ = [
    "CSRC", "LIBRARIES", "host_check", "load", "load_library", "prebuild", "JitError", "nvcc_path",
    "bind_param_block", "check_param_block",
]  # fmt: skip


def _find_csrc() -> Path:
    """The CUDA C++ sources: ``peerdcp/csrc/`` in an installed wheel (setup.py copies them there), else the
    checkout's top-level ``csrc/`` (DESIGN.md section 2; an editable install). The wheel's place is tried first, so
    a stray ``csrc`` folder beside an installed package is never taken."""
    here = Path(__file__).resolve().parents[1]  # the package folder
    for cand in (here / "csrc", here.parent / "csrc"):
        if (cand / "peer_memory.cuh").is_file():
            return cand
    return here.parent / "csrc"


CSRC = _find_csrc()
DEFAULT_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "--use_fast_math", "-lineinfo")


class JitError(RuntimeError):
    pass


def nvcc_path() -> str | None:
    for cand in (os.environ.get("PEERDCP_NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if cand and os.path.exists(cand):
            return cand
    return None


def _cache_dir() -> Path:
    return Path(os.environ.get("PEERDCP_CACHE", Path.home() / ".cache" / "peerdcp"))


def _target(name: str, sources: tuple[str, ...], flags: tuple[str, ...]) -> tuple[list[Path], Path, Path]:
    """Sources, cache folder and library path; the folder is keyed by sources, headers and flags."""
    paths = [CSRC / s for s in sources]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        raise JitError(
            f"the CUDA C++ sources are missing ({', '.join(missing)}): this peerdcp was installed without them; "
            "install it from a wheel or source distribution of this version, or from a checkout"
        )
    h = hashlib.sha256()
    for p in paths:
        h.update(p.relative_to(CSRC).as_posix().encode())
        h.update(p.read_bytes())
    for hdr in sorted(CSRC.rglob("*.cuh")):
        h.update(hdr.read_bytes())
    h.update(" ".join(flags).encode())
    out_dir = _cache_dir() / f"{name}-{h.hexdigest()[:16]}"
    return paths, out_dir, out_dir / f"lib{name}.so"


def _ensure_built(name: str, sources: tuple[str, ...], flags: tuple[str, ...]) -> Path:
    """Path of ``lib<name>.so``, built first if the cache lacks it (file lock: W ranks build once)."""
    paths, out_dir, lib = _target(name, sources, flags)
    if not lib.exists():
        if os.environ.get("PEERDCP_NO_JIT") == "1":
            raise JitError(f"{lib} is not built and PEERDCP_NO_JIT=1 forbids compiling")
        nvcc = nvcc_path()
        if nvcc is None:
            raise JitError("nvcc not found (set PEERDCP_NVCC); the CUDA C++ kernels cannot be built")
        out_dir.mkdir(parents=True, exist_ok=True)
        with open(out_dir / ".lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not lib.exists():
                _build(nvcc, paths, flags, out_dir, lib)
    return lib


@functools.cache
def load_library(name: str, sources: tuple[str, ...], flags: tuple[str, ...] = DEFAULT_FLAGS) -> ctypes.CDLL:
    """Build (if needed) ``lib<name>.so`` from ``csrc/<sources>`` and return it loaded."""
    return ctypes.CDLL(str(_ensure_built(name, sources, flags)))


def host_check() -> bool:
    """``PEERDCP_JIT_HOST_CHECK=1``: build the libraries for calling their host entry points only, on a machine
    without a GPU (the CPU tests set it there: parameter-block mirrors, input checks, host-side tables). The
    device code then goes no further than unoptimized PTX (``code=compute_XX``, ``-Xcicc -O0``): the output
    library builds in ~8 s instead of ~65 s on two cores. Such a build never runs a kernel: :func:`load`
    refuses it where a GPU is visible."""
    return os.environ.get("PEERDCP_JIT_HOST_CHECK", "0") == "1"


def _flags(flags: tuple[str, ...]) -> tuple[str, ...]:
    """``flags`` (their host-check form under :func:`host_check`) plus ``$PEERDCP_NVCC_EXTRA`` (space-separated;
    for tuning sweeps such as ``scripts/diag/output_tune.py`` (in git history) only: the extra flags are part of the
    cache key, so
    each setting is its own build, and nothing in the package sets them)."""
    if host_check():
        flags = (*(re.sub(r"code=sm_(\w+)", r"code=compute_\1", f) for f in flags), "-Xcicc", "-O0")
    return (*flags, *os.environ.get("PEERDCP_NVCC_EXTRA", "").split())


def load(name: str) -> ctypes.CDLL:
    """Build (if needed) and load the library ``name`` of :data:`LIBRARIES`."""
    if host_check():
        import torch

        if torch.cuda.is_available():
            raise JitError("PEERDCP_JIT_HOST_CHECK=1 builds libraries that must not run kernels; unset it on a GPU")
    sources, flags = LIBRARIES[name]
    return load_library(name, sources, _flags(flags))


def _build(nvcc: str, paths: list[Path], flags: tuple[str, ...], out_dir: Path, lib: Path) -> None:
    cflags = " ".join((*flags, "-Xcompiler", "-fPIC", f"-I{CSRC}"))
    objs = [p.relative_to(CSRC).with_suffix(".o").as_posix().replace("/", "_") for p in paths]
    ninja = shutil.which("ninja")
    tmp = lib.with_suffix(".so.tmp")
    if ninja:
        lines = [
            f"nvcc = {nvcc}",
            f"cflags = {cflags}",
            "rule cu\n  command = $nvcc $cflags -c $in -o $out",
            "rule link\n  command = $nvcc -shared $in -o $out",
        ]
        lines += [f"build {o}: cu {p}" for o, p in zip(objs, paths)]
        lines.append(f"build {tmp.name}: link {' '.join(objs)}")
        (out_dir / "build.ninja").write_text("\n".join(lines) + "\n")
        cmd = [ninja, "-C", str(out_dir)]
    else:
        cmd = [nvcc, *cflags.split(), "-shared", *map(str, paths), "-o", str(tmp)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise JitError(f"building {lib.name} failed:\n{res.stdout}\n{res.stderr}")
    os.replace(tmp, lib)


#: every C++ library the package loads: name -> (sources, flags); the mechanisms load them with
#: :func:`load`, and ``python -m peerdcp._runtime.jit`` builds them all
LIBRARIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "peerdcp_output": (("output/direct.cu",), DEFAULT_FLAGS),
    "peerdcp_topk": (("topk/merge.cu", "topk/select.cu"), DEFAULT_FLAGS),
    # no --use_fast_math: no flush-to-zero, and -fmad=false keeps every fp32 rounding of the reference
    "peerdcp_query": (
        ("query/direct.cu",),
        ("-O3", "-std=c++17", "-gencode=arch=compute_90,code=sm_90", "-fmad=false", "-lineinfo"),
    ),
    "peerdcp_selftest": (("memory/selftest.cu",), DEFAULT_FLAGS),
    # warpgroup MMA and bulk copies: the architecture-specific sm_90a target (Hopper only)
    "peerdcp_score": (
        ("topk/score.cu",),
        ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "--use_fast_math", "-lineinfo"),
    ),
}


def prebuild() -> list[Path]:
    """Build every library into the cache without loading it (needs nvcc, not a GPU): a build machine can
    fill ``$PEERDCP_CACHE`` and ship it to GPU machines that should not spend time compiling."""
    return [_ensure_built(name, sources, _flags(flags)) for name, (sources, flags) in LIBRARIES.items()]


def check_param_block(lib: ctypes.CDLL, size_fn: str, mirror: type[ctypes.Structure]) -> None:
    """The C boundary's one convention: a launcher takes one parameter block, whose C size ``lib.<size_fn>()``
    must equal its ctypes ``mirror``'s (a field added on one side only would shift every field after it).
    Raises RuntimeError naming both."""
    fn = getattr(lib, size_fn)
    fn.restype, fn.argtypes = ctypes.c_int, []
    size = fn()
    if size != ctypes.sizeof(mirror):
        raise RuntimeError(
            f"{size_fn}() says the C {mirror.__name__} is {size} bytes, its ctypes mirror ({mirror.__module__}) "
            f"{ctypes.sizeof(mirror)}: keep the two in sync"
        )


def bind_param_block(lib: ctypes.CDLL, entries: tuple[str, ...], size_fn: str, mirror: type[ctypes.Structure]) -> None:
    """Declare the launchers ``entries`` (the parameter block, its size, the stream; a cudaError_t back) and check
    the block's size (:func:`check_param_block`)."""
    for name in entries:
        fn = getattr(lib, name)
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p]
    check_param_block(lib, size_fn, mirror)


if __name__ == "__main__":
    for p in prebuild():
        print(p)
