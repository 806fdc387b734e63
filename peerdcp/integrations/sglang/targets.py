"""The SGLang functions the plugin hooks, and how each one is found in the installed version.

Two kinds of target:

* **eager** targets live in modules that import cheaply (``server_args``, ``layers.dcp.comm``,
  ``distributed.parallel_state``): they are imported, checked, and handed to SGLang's own
  ``HookRegistry`` (which also rewrites stale ``from X import Y`` bindings in modules already loaded).
* **lazy** targets live in modules that pull the whole model-execution stack (``model_executor.runner``
  imports transformers, torchvision, FlashInfer, ...). Importing them from ``load_plugins()`` would load
  that stack in SGLang's launcher process and fail on a CPU-only machine, so the plugin checks them by
  reading the module's *source* (``ast``: the class and method exist) and patches them when SGLang itself
  imports the module (a ``sys.meta_path`` post-import hook).

A target that is missing in the installed SGLang raises :class:`HookTargetError` naming the target and the
installed version.
"""

from __future__ import annotations

import ast
import importlib
import importlib.abc
import importlib.util
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass

__all__ = [
    "SUPPORTED_SGLANG",
    "HookTargetError",
    "Target",
    "TARGETS",
    "sglang_version",
    "verify",
    "verify_all",
    "patch_when_imported",
]

logger = logging.getLogger("peerdcp.sglang")

SUPPORTED_SGLANG = "0.5.23"


class HookTargetError(RuntimeError):
    """A function the plugin hooks does not exist in the installed SGLang."""


@dataclass(frozen=True)
class Target:
    """A hooked SGLang attribute: ``module`` + ``qualname`` (``Class.method`` or ``function``)."""

    module: str
    qualname: str
    lazy: bool = False
    why: str = ""

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.qualname}"


TARGETS: dict[str, Target] = {
    "add_cli_args": Target(
        "sglang.srt.server_args", "ServerArgs.add_cli_args", why="adds the flags and widens --dcp-comm-backend"
    ),
    "from_cli_args": Target(
        "sglang.srt.server_args",
        "ServerArgs.from_cli_args",
        why="validates the flags and exports them to the worker processes",
    ),
    "resolution": Target(
        "sglang.srt.arg_groups.parallel_hook",
        "handle_decode_context_parallelism",
        lazy=True,
        why="resolution step (register_resolution_hook): validation with the model config, Engine API path",
    ),
    "dcp_a2a_lse_reduce": Target(
        "sglang.srt.layers.dcp.comm", "dcp_a2a_lse_reduce", why="merge for a2a-like backends, returns [T, H, D]"
    ),
    "cp_lse_ag_out_rs_mla": Target(
        "sglang.srt.layers.dcp.comm",
        "cp_lse_ag_out_rs_mla",
        why="merge for every other backend value (vmm, symm_a2a included), returns [H, T, D]",
    ),
    "all_gather_q_for_mla_decode": Target(
        "sglang.srt.layers.dcp.comm", "all_gather_q_for_mla_decode", why="MLA decode query gather (vmm_direct)"
    ),
    "pre_capture": Target(
        "sglang.srt.model_executor.runner.base_runner",
        "BaseRunner._pre_initialize_fi_a2a_workspace",
        lazy=True,
        why="creates the peerdcp workspaces before CUDA-graph capture",
    ),
    "shutdown": Target(
        "sglang.srt.distributed.parallel_state",
        "destroy_model_parallel",
        why="closes the peerdcp workspaces (collective) before SGLang destroys its groups",
    ),
}


def sglang_version() -> str:
    try:
        from importlib.metadata import version

        return version("sglang")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        try:
            import sglang

            return str(getattr(sglang, "__version__", "unknown"))
        except Exception:  # noqa: BLE001
            return "not installed"


def _missing(target: Target, detail: str) -> HookTargetError:
    return HookTargetError(
        f"peerdcp SGLang plugin: hook target {target.dotted} ({target.why}) cannot be found in the "
        f"installed sglang {sglang_version()}: {detail}. peerdcp's plugin is written against "
        f"sglang=={SUPPORTED_SGLANG}; install that version or update peerdcp."
    )


def _source_path(module: str) -> str | None:
    """File of ``module`` inside the installed sglang package, found without importing the module (importing
    a submodule would run its parents' ``__init__``, which for the runner package loads the model stack)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    rel = module.split(".")[1:]
    for cand in (os.path.join(root, *rel) + ".py", os.path.join(root, *rel, "__init__.py")):
        if os.path.isfile(cand):
            return cand
    return None


def _check_source(target: Target) -> None:
    path = _source_path(target.module)
    if path is None:
        raise _missing(target, f"module {target.module} not found")
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), filename=path)
    parts = target.qualname.split(".")
    scope: list[ast.stmt] = tree.body
    for i, name in enumerate(parts):
        node = next(
            (
                n
                for n in scope
                if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == name
            ),
            None,
        )
        if node is None:
            where = target.module if i == 0 else ".".join(parts[:i])
            raise _missing(target, f"{where} defines no {name!r} ({path})")
        scope = node.body if isinstance(node, ast.ClassDef) else []


def resolve(target: Target) -> tuple[object, str, object]:
    """Import ``target`` (eager targets only) -> (owner object, attribute name, current value)."""
    try:
        obj: object = importlib.import_module(target.module)
    except ImportError as e:
        raise _missing(target, f"cannot import {target.module} ({type(e).__name__}: {e})") from e
    parts = target.qualname.split(".")
    for name in parts[:-1]:
        if not hasattr(obj, name):
            raise _missing(target, f"{target.module} has no {name!r}")
        obj = getattr(obj, name)
    if not hasattr(obj, parts[-1]):
        raise _missing(target, f"{getattr(obj, '__name__', obj)} has no {parts[-1]!r}")
    return obj, parts[-1], getattr(obj, parts[-1])


def verify(target: Target) -> None:
    """Raise :class:`HookTargetError` if ``target`` does not exist in the installed SGLang."""
    if target.lazy:
        _check_source(target)
    else:
        resolve(target)


def verify_all(targets: dict[str, Target] | None = None) -> dict[str, str]:
    """Check every target; returns ``{name: "ok" | error message}`` (never raises)."""
    out = {}
    for name, t in (TARGETS if targets is None else targets).items():
        try:
            verify(t)
            out[name] = "ok"
        except HookTargetError as e:
            out[name] = str(e)
    return out


# --- lazy patching -------------------------------------------------------------------------------------------
_PENDING: dict[str, list[tuple[Target, Callable[[object, str], None]]]] = {}


class _PostImportFinder(importlib.abc.MetaPathFinder):
    """Wraps the loader of watched modules so that their patches run right after the module executes."""

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib protocol
        if fullname not in _PENDING:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        original_exec = loader.exec_module

        def exec_module(module):  # noqa: ANN001
            original_exec(module)
            _apply_pending(fullname, module)

        # A per-spec shim, so the shared loader class is untouched.
        spec.loader = _LoaderShim(loader, exec_module)
        return spec


class _LoaderShim(importlib.abc.Loader):
    def __init__(self, inner, exec_module) -> None:  # noqa: ANN001
        self._inner = inner
        self._exec = exec_module

    def create_module(self, spec):  # noqa: ANN001
        return self._inner.create_module(spec)

    def exec_module(self, module) -> None:  # noqa: ANN001
        self._exec(module)

    def __getattr__(self, name: str):
        return getattr(self._inner, name)


_FINDER = _PostImportFinder()


def _apply_pending(module_name: str, module: object) -> None:
    for target, apply in _PENDING.pop(module_name, []):
        obj: object = module
        parts = target.qualname.split(".")
        for name in parts[:-1]:
            obj = getattr(obj, name, None)
            if obj is None:
                raise _missing(target, f"{module_name} has no {name!r} at import")
        if not hasattr(obj, parts[-1]):
            raise _missing(target, f"{getattr(obj, '__name__', obj)} has no {parts[-1]!r} at import")
        apply(obj, parts[-1])
        logger.info("peerdcp: hooked %s", target.dotted)
    if not _PENDING and _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)


def patch_when_imported(target: Target, apply: Callable[[object, str], None]) -> None:
    """Run ``apply(owner, attr)`` on ``target`` now if its module is loaded, else right after SGLang imports it."""
    module = sys.modules.get(target.module)
    _PENDING.setdefault(target.module, []).append((target, apply))
    if module is not None:
        _apply_pending(target.module, module)
    elif _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
