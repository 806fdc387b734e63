"""Whether two trees' CUDA kernels have the same machine code: a check for a change that must not touch any
kernel's instructions (a move, a rename, a host-side launcher change). Needs nvcc and binutils' readelf, no GPU.

    python scripts/kernel_diff.py OLD_TREE [NEW_TREE]     (NEW_TREE defaults to this checkout)

Each tree's libraries (its jit module's ``LIBRARIES``: sources and flags) are compiled to sm_90 cubins without
``-lineinfo`` (line tables differ whenever a line moves). Per library (its sources together) and kernel, the
``.text`` section (the instructions) and the ``.nv.constant0`` section (the parameter block's size) are compared
byte for byte, the kernels matched by their mangled names with the anonymous namespace's per-file hash removed
(it changes with the file's path).
Exit status 0 when every kernel of each library is in both trees with the same bytes.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from peerdcp._runtime.jit import nvcc_path

_LIBRARIES = """
import json
try:
    from peerdcp._runtime import jit
except ImportError:  # a tree from before peerdcp/_runtime/
    from peerdcp import jit
print(json.dumps({n: [list(s), list(f), str(jit.CSRC)] for n, (s, f) in jit.LIBRARIES.items()}))
"""
_ANON = re.compile(r"_ZN\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]+")
_SECTION = re.compile(r"\]\s+(\S+)\s+(\S+)\s+[0-9a-f]+\s+([0-9a-f]+)\s+([0-9a-f]+)")


def libraries(tree: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _LIBRARIES], cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def compile_cubin(nvcc: str, src: Path, flags: list[str], include: str, out: Path) -> Path:
    flags = [f for f in flags if f != "-lineinfo"]
    subprocess.run([nvcc, *flags, "-cubin", f"-I{include}", str(src), "-o", str(out)], check=True)
    return out


def kernel_sections(cubin: Path) -> dict[str, bytes]:
    """``{section name with the anonymous-namespace hash removed: bytes}`` of the .text and .nv.constant0 sections."""
    table = subprocess.run(["readelf", "-S", "-W", str(cubin)], capture_output=True, text=True, check=True).stdout
    data = cubin.read_bytes()
    found = {}
    for m in _SECTION.finditer(table):
        name, kind, off, size = m.group(1), m.group(2), int(m.group(3), 16), int(m.group(4), 16)
        if name.startswith((".text.", ".nv.constant0.")):
            found[_ANON.sub("_ZN<anon>", name)] = str(size).encode() if kind == "NOBITS" else data[off : off + size]
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("old", type=Path)
    p.add_argument("new", type=Path, nargs="?", default=Path(__file__).resolve().parents[1])
    a = p.parse_args()
    nvcc = nvcc_path()  # the compiler the JIT builds with (PEERDCP_NVCC, else PATH)
    if nvcc is None:
        print("nvcc not found (set PEERDCP_NVCC)")
        return 2
    old, new = libraries(a.old), libraries(a.new)
    if set(old) != set(new):
        print(f"libraries differ: {sorted(old)} vs {sorted(new)}")
        return 1
    ok = True
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(4) as pool:
        jobs = {}
        for side, libs in (("old", old), ("new", new)):
            for name, (sources, flags, csrc) in libs.items():
                for i, s in enumerate(sources):
                    out = Path(tmp) / f"{side}-{name}-{i}.cubin"
                    jobs[side, name, i] = pool.submit(compile_cubin, nvcc, Path(csrc) / s, flags, csrc, out)
        for name in sorted(new):
            o, n = {}, {}
            for (side, lib, _), job in jobs.items():
                if lib == name:
                    (o if side == "old" else n).update(kernel_sections(job.result()))
            kernels = [k for k in n if k.startswith(".text.")]
            differ = sorted(k for k in set(o) | set(n) if o.get(k) != n.get(k))
            ok &= not differ
            print(f"{name} ({', '.join(new[name][0])}): {len(kernels)} kernels, {len(differ)} sections differ")
            for k in differ[:5]:
                print(f"  {k[:120]}")
    print("same machine code" if ok else "machine code differs")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
