"""peerdcp as an SGLang general plugin: DCP flags, their validation, and hooks that route SGLang's DCP
exchanges to peerdcp (DESIGN.md section 7; what is and is not routed: ``docs/sglang.md``).

Installed through the entry point ``[project.entry-points."sglang.srt.plugins"] peerdcp =
"peerdcp.integrations.sglang:register"``. SGLang's ``load_plugins()`` runs :func:`register` in the launcher
*before* it builds its argument parser, and again in every scheduler / worker process; ``register`` then
hands its hooks to SGLang's ``HookRegistry`` (applied right after by ``load_plugins``).

Lifecycle in a server::

    launcher   load_plugins -> register        flags added to SGLang's parser (ServerArgs.add_cli_args)
               prepare_server_args             from_cli_args hook: validate, export PEERDCP_SGLANG_* env
               resolve_once                    resolution hook: validate with the model config
    worker     load_plugins -> register        hooks on the DCP merge / query functions
               BaseRunner._warmup              pre-capture hook: probe + create peerdcp objects
               forward (eager / graph replay)  SGLang's merge / gather calls -> peerdcp
               destroy_model_parallel          workspaces closed (collective)

``register`` raises :class:`HookTargetError` (SGLang logs it with its traceback) when a hooked function is
missing from the installed SGLang; a later request for a peer route then fails validation with the same
message instead of silently running SGLang's collectives.
"""

from __future__ import annotations

import logging
from typing import Any

from ...errors import PeerSetupError
from . import options as _opt
from .options import Options, current
from .routes import WORKSPACES, gather_query, group_parts, merge, stats
from .targets import SUPPORTED_SGLANG, TARGETS, HookTargetError, sglang_version, verify_all

__all__ = [
    "register",
    "Options",
    "current",
    "stats",
    "HookTargetError",
    "TARGETS",
    "SUPPORTED_SGLANG",
    "verify_all",
    "load_errors",
    "WORKSPACES",
]

logger = logging.getLogger("peerdcp.sglang")

_REGISTERED = False
_LOAD_ERRORS: list[str] = []
_ORIGINALS: dict[str, Any] = {}


def load_errors() -> list[str]:
    """Hook targets that were missing when :func:`register` ran in this process."""
    return list(_LOAD_ERRORS)


# --- CLI hooks -------------------------------------------------------------------------------------------------
def _after_add_cli_args(result: Any, parser: Any) -> None:
    """AFTER ``ServerArgs.add_cli_args(parser)``: widen ``--dcp-comm-backend``, add the new flags."""
    if not _opt.widen_comm_choices(parser):
        raise HookTargetError(
            f"peerdcp SGLang plugin: sglang {sglang_version()}'s parser has no --dcp-comm-backend option to extend"
        )
    _opt.add_flags(parser)
    return None


def _device_of(ns_or_cfg: Any) -> str | None:
    return getattr(ns_or_cfg, "device", None)


def _validate(opts: Options, src: Any, *, index_topk: Any) -> None:
    found = []
    if _LOAD_ERRORS and opts.peer_routes():
        found.extend(_LOAD_ERRORS)
    found += _opt.problems(
        opts,
        dcp_size=int(getattr(src, "dcp_size", 1) or 1),
        cuda=_opt.cuda_available(_device_of(src)),
        replicate_q_proj=getattr(src, "dcp_replicate_q_proj", None),
        two_batch_overlap=bool(getattr(src, "enable_two_batch_overlap", False)),
        index_topk=index_topk,
    )
    _opt.raise_problems(found)


def _around_from_cli_args(original: Any, cls: Any, args: Any) -> Any:
    """AROUND ``ServerArgs.from_cli_args(args)``: validate the namespace (messages reach SGLang's CLI), pin
    ``dcp_replicate_q_proj`` off for ``vmm_direct`` (SGLang's DSA override would turn it on for ``a2a``), and
    export the values for the worker processes -- the record SGLang builds keeps none of the new flags."""
    opts = Options.from_namespace(args)
    index_topk = _opt.index_topk_from_model_path(
        getattr(args, "model_path", None), getattr(args, "json_model_override_args", None)
    )
    _validate(opts, args, index_topk=index_topk)
    if opts.query_backend == "vmm_direct" and getattr(args, "dcp_replicate_q_proj", None) is None:
        args.dcp_replicate_q_proj = False
    opts.export_env()
    return original(cls, args)


def _resolution_step(server_args: Any, previous: Any) -> None:
    """Wraps SGLang's ``handle_decode_context_parallelism`` resolution step: validate against the resolved
    record and the model's HF config (index_topk), and export the values (the ``Engine`` API path, which has
    no argparse step, passes through here too)."""
    from sglang.srt.arg_groups.overrides import declare_resolution, model_config_of, resolving_view

    cfg = resolving_view(server_args)
    opts = Options.from_env()
    opts = Options(
        comm_backend=cfg.dcp_comm_backend if cfg.dcp_comm_backend is not None else opts.comm_backend,
        query_backend=opts.query_backend,
        indexer_backend=opts.indexer_backend,
        topk_backend=opts.topk_backend,
        peer_fallback=opts.peer_fallback,
    )
    index_topk = _opt.UNKNOWN
    if opts.indexer_backend != "replicated" or opts.topk_backend != "allgather":
        try:
            index_topk = _opt.index_topk_of(model_config_of(server_args).hf_config)
        except Exception as e:  # noqa: BLE001 - the model config is SGLang's business; keep validating
            logger.warning("peerdcp: could not read index_topk from the model config (%s)", e)
    _validate(opts, cfg, index_topk=index_topk)
    if opts.query_backend == "vmm_direct" and cfg.dcp_replicate_q_proj is None:
        declare_resolution(server_args, "peerdcp --dcp-query-backend vmm_direct", dcp_replicate_q_proj=False)
    opts.export_env()
    previous(server_args)


# --- DCP hooks ---------------------------------------------------------------------------------------------------
_A2A_PARAMS = ("cp_attn_out", "cp_attn_lse", "cp_group", "is_lse_base_on_e", "cuda_graph_buffers", "comm_backend")
_AGRS_PARAMS = ("cp_attn_out", "cp_attn_lse", "cp_group", "ctx", "is_lse_base_on_e")


def _bind(args: tuple, kwargs: dict, params: tuple) -> dict:
    """Keyword view of a call to a function whose leading parameters are ``params``."""
    d = dict(zip(params, args))
    d.update(kwargs)
    return d


def _around_a2a(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``dcp_a2a_lse_reduce``: ``[T, W*H, D]`` -> ``[T, H, D]``."""
    call = _bind(args, kwargs, _A2A_PARAMS)
    backend = call.get("comm_backend")
    if backend is None:  # not passed: the configured backend decides
        configured = current().comm_backend
        backend = configured if configured in _opt.PEER_COMM else "a2a"
    if backend not in _opt.PEER_COMM:
        return original(*args, **kwargs)
    res = merge(
        backend, call["cp_attn_out"], call["cp_attn_lse"], call["cp_group"], bool(call.get("is_lse_base_on_e", True))
    )
    if res is not None:
        return res
    # Not served by peer memory (T above the inbox, fallback, world size 1, ...): SGLang's own a2a.
    call["comm_backend"] = "a2a"
    return original(**call)


def _around_ag_rs(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``cp_lse_ag_out_rs_mla``: ``[T, W*H, D]`` -> ``[H, T, D]`` (a transposed view)."""
    backend = current().comm_backend
    if backend not in _opt.PEER_COMM:
        return original(*args, **kwargs)
    call = _bind(args, kwargs, _AGRS_PARAMS)
    out_, lse, group = call["cp_attn_out"], call["cp_attn_lse"], call["cp_group"]
    base_e = bool(call.get("is_lse_base_on_e", False))
    res = merge(backend, out_, lse, group, base_e)
    if res is not None:
        return res.transpose(0, 1)
    a2a = _ORIGINALS.get("dcp_a2a_lse_reduce")
    if backend in WORKSPACES.fallback and a2a is not None and group_parts(group)[2] > 1:
        # --dcp-peer-fallback a2a: SGLang's a2a exchange, in the layout this call site expects.
        res = a2a(out_.contiguous(), lse.contiguous(), group, is_lse_base_on_e=base_e, comm_backend="a2a")
        return res.transpose(0, 1)
    return original(*args, **kwargs)


def _around_q_gather(original: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND ``all_gather_q_for_mla_decode(q_nope_out, q_pe)``."""
    if current().query_backend != "vmm_direct":
        return original(*args, **kwargs)
    q_nope = args[0] if args else kwargs["q_nope_out"]
    q_pe = args[1] if len(args) > 1 else kwargs["q_pe"]
    from sglang.srt.runtime_context import get_parallel

    res = gather_query(q_nope, q_pe, get_parallel().dcp_group)
    return res if res is not None else original(*args, **kwargs)


def _find_mla_geometry(model: Any) -> dict | None:
    """Heads, ranks and LSE base of the model's DCP MLA attention (None: no DCP attention, e.g. a draft)."""
    if model is None or not hasattr(model, "modules"):
        return None
    for m in model.modules():
        if getattr(m, "attn_mqa_for_dcp_decode", None) is None or int(getattr(m, "dcp_size", 1)) <= 1:
            continue
        backend = getattr(m, "current_attention_backend", None)
        try:
            from sglang.srt.models.deepseek_common.attention_forward_methods.forward_mla import (
                is_mla_dcp_lse_base_on_e,
            )

            base_e = is_mla_dcp_lse_base_on_e(backend)
        except Exception:  # noqa: BLE001 - same rule as SGLang 0.5.23's, if its model module cannot load
            base_e = backend in {"flashmla", "cutedsl_mla", "aiter"}
        return {
            "heads_per_rank": int(m.num_local_heads),
            "kv_lora_rank": int(m.kv_lora_rank),
            "rope_dim": int(m.qk_rope_head_dim),
            "lse_base": "e" if base_e else 2,
        }
    return None


def _after_pre_capture(result: Any, runner: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``BaseRunner._pre_initialize_fi_a2a_workspace``: create the workspaces before graph capture."""
    opts = current()
    if not opts.peer_routes():
        return None
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    if not getattr(parallel, "dcp_enabled", False):
        return None
    mr = runner.model_runner
    geo = _find_mla_geometry(getattr(mr, "model", None))
    if geo is None:
        # No DCP MLA attention here. An MLA model's draft (NextN, dcp 1) is such a runner and needs nothing; a
        # model that is not MLA at all runs SGLang's MHA DCP path, which no peer route replaces: fail start-up
        # rather than serve the flags silently with SGLang's collectives.
        arch = getattr(getattr(mr, "model_config", None), "attention_arch", None)
        if arch is not None and getattr(arch, "name", str(arch)) != "MLA":
            raise PeerSetupError(
                f"peerdcp: {', '.join(opts.peer_routes())} replace(s) the MLA DCP exchanges, but this model's "
                f"attention is {getattr(arch, 'name', arch)} (SGLang's MHA DCP path, which peerdcp does not hook); "
                "drop the flag(s)"
            )
        return None
    rows = None
    widest = getattr(runner, "_widest_decode_rows", None)
    if widest is not None:
        try:
            rows = widest()
        except Exception as e:  # noqa: BLE001 - fall back to the default size
            logger.warning("peerdcp: could not size the workspaces from the capture batch sizes (%s)", e)
    WORKSPACES.prepare(
        parallel.dcp_group,
        dtype=mr.dtype,
        max_tokens=int(rows or _opt.default_max_tokens()),
        **geo,
    )
    logger.info("peerdcp: SGLang DCP workspaces ready: %s", stats()["objects"])
    return None


def _before_destroy(*args: Any, **kwargs: Any) -> None:
    """BEFORE ``destroy_model_parallel``: close the workspaces while the DCP group still exists."""
    WORKSPACES.close_all()
    return None


# --- registration --------------------------------------------------------------------------------------------------
def register() -> None:
    """The SGLang plugin entry point (idempotent). Raises :class:`HookTargetError` naming every hook target
    missing from the installed SGLang (after installing the hooks that do resolve)."""
    global _REGISTERED
    if _REGISTERED:
        return
    _REGISTERED = True
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    from .targets import patch_when_imported, resolve, verify

    version = sglang_version()
    if version != SUPPORTED_SGLANG:
        logger.warning("peerdcp: SGLang plugin written against sglang %s, found %s", SUPPORTED_SGLANG, version)
    hooks = {
        "add_cli_args": (_after_add_cli_args, HookType.AFTER),
        "from_cli_args": (_around_from_cli_args, HookType.AROUND),
        "dcp_a2a_lse_reduce": (_around_a2a, HookType.AROUND),
        "cp_lse_ag_out_rs_mla": (_around_ag_rs, HookType.AROUND),
        "all_gather_q_for_mla_decode": (_around_q_gather, HookType.AROUND),
        "shutdown": (_before_destroy, HookType.BEFORE),
    }
    errors: list[str] = []
    for name, (fn, kind) in hooks.items():
        t = TARGETS[name]
        try:
            _, _, value = resolve(t)
        except HookTargetError as e:
            errors.append(str(e))
            continue
        _ORIGINALS[name] = value
        HookRegistry.register(t.dotted, fn, kind)
    # Resolution step: SGLang's own plugin API for named pipeline steps.
    t = TARGETS["resolution"]
    try:
        verify(t)
        from sglang.srt.arg_groups.resolution_hooks import register_resolution_hook

        register_resolution_hook(t.qualname)(_resolution_step)
    except (HookTargetError, ValueError, ImportError) as e:
        errors.append(str(e) if isinstance(e, HookTargetError) else f"{t.dotted}: {e}")
    # Pre-capture workspace step: module too heavy to import here; checked from source, patched on import.
    t = TARGETS["pre_capture"]
    try:
        verify(t)

        def apply(owner: Any, attr: str) -> None:
            original = getattr(owner, attr)

            def wrapper(self, *a, **k):  # noqa: ANN001
                result = original(self, *a, **k)
                _after_pre_capture(result, self, *a, **k)
                return result

            wrapper.__wrapped__ = original
            wrapper.__name__ = getattr(original, "__name__", attr)
            setattr(owner, attr, wrapper)

        patch_when_imported(t, apply)
    except HookTargetError as e:
        errors.append(str(e))
    _LOAD_ERRORS[:] = errors
    _apply_if_called_directly(HookRegistry)
    if errors:
        raise HookTargetError("\n".join(errors))


def _apply_if_called_directly(registry: Any) -> None:
    """SGLang's ``load_plugins`` applies every plugin's hooks once, after all plugins ran. When ``register``
    is called by hand instead (peerdcp importable but not pip-installed, so no entry point; or a custom
    launcher), that step has already happened or never will: apply now. Inside ``load_plugins`` (a plugin
    source is set) applying early would freeze targets other plugins still want to hook, so leave it."""
    try:
        from sglang.srt.plugins.hook_registry import _current_plugin_source
    except ImportError:  # a newer SGLang without it: applying is idempotent, do it
        _current_plugin_source = None
    if _current_plugin_source is None or _current_plugin_source.get() is None:
        registry.apply_hooks()
