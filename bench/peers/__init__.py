"""Peers' DCP exchanges loaded for same-run baselines (issue 54), without their heavy packages.

vLLM 0.34.0 ships its DCP Output exchange in ``vllm/v1/attention/ops/dcp.py``, whose module-level imports pull in
vLLM's config, distributed state, platform probing and JIT-warmup runtime (torch 2.14 wheels, compiled ``_C``).
The a2a pack (``_dcp_a2a_pack_send``), its combine (``_dcp_a2a_unpack_combine``) and the ag_rs correction
(``CorrectAttnCPOutKernel.kernel``) are plain Triton kernels that need none of that, so :func:`load_vllm_dcp`
loads that one file from the wheel's extracted tree (``scripts/setup_peers.sh`` puts it under ``/.peers/``;
``PEERDCP_PEERS`` overrides) after registering stand-in modules for the names it imports; :func:`load_vllm_file`
does the same for the Query (``bench.peers.fused_q``) and Top-K (``bench.peers.topk``) files. The stand-ins are
placeholders (no vLLM code): what needs the real runtime (the JIT-warmup launcher, the symmetric-memory
workspaces, vLLM's compiled ``torch.ops._C``, the CuTeDSL kernels) is reported with the reason by :func:`status`,
:data:`QUERY_PEERS` and :data:`TOPK_PEERS`.

Every loader returns ``(module or None, reason)`` so that a benchmark can say which peer it skipped and why.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types
from pathlib import Path

VLLM_VERSION = "0.34.0"
FLASHINFER_VERSION = "0.7.4"
ROOT = Path(os.environ.get("PEERDCP_PEERS", Path(__file__).resolve().parents[2] / ".peers"))

_VLLM_DCP = "vllm/v1/attention/ops/dcp.py"
_cache: dict[str, tuple[types.ModuleType | None, str]] = {}


class _Placeholder:
    """A base class / callable standing in for a vLLM runtime name that the a2a kernels never use."""

    def __class_getitem__(cls, _item):
        return cls

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a vLLM runtime placeholder was called: this path needs the real vLLM package")


def _never(*args, **kwargs):
    raise RuntimeError("a vLLM runtime placeholder was called: this path needs the real vLLM package")


def _identity(fn):
    """Stand-in for a decorator (``kernel_launcher``): the method stays as written, unregistered."""
    return fn


def _stub(name: str, **attrs) -> None:
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    mod.__path__ = []  # a package, so that submodule stand-ins resolve
    mod.__peerdcp_stub__ = True
    sys.modules.setdefault(name, mod)


def _install_vllm_stubs() -> None:
    """Register the stand-ins for the modules ``dcp.py`` imports at module level (only where absent)."""
    import triton
    import triton.language as tl

    class _Envs(types.ModuleType):
        def __getattr__(self, name):  # every VLLM_* switch off: no direct / multicast path is chosen
            if name.startswith("VLLM_"):
                return False
            raise AttributeError(name)

    for pkg in (
        "vllm",
        "vllm.model_executor",
        "vllm.model_executor.warmup",
        "vllm.v1",
        "vllm.v1.attention",
        "vllm.v1.attention.ops",
        "vllm.v1.worker",
    ):
        _stub(pkg)
    sys.modules.setdefault("vllm.envs", _Envs("vllm.envs"))
    _stub("vllm.config", VllmConfig=_Placeholder)
    _stub("vllm.distributed", get_dcp_group=_never)
    _stub("vllm.logger", init_logger=logging.getLogger)
    _stub("vllm.model_executor.warmup.jit_warmup", WarmupIntRange=_Placeholder, kernel_launcher=_identity)
    _stub(
        "vllm.model_executor.warmup.jit_warmup_triton_helper",
        LaunchSpec=_Placeholder,
        TritonWarmupTensor=_Placeholder,
        VllmTritonJitKernel=_Placeholder,
        triton_scalar_specialization_rep=_never,
    )
    _stub("vllm.triton_utils", tl=tl, triton=triton, HAS_TRITON=True)
    _stub("vllm.v1.attention.backend", max_decode_query_len=_never)
    _stub(
        "vllm.v1.attention.ops.cp_common",
        DirectCPWorkspace=_Placeholder,
        direct_cp_enabled=lambda *a, **k: False,
        direct_cp_multicast_enabled=lambda *a, **k: False,
    )
    _stub("vllm.v1.worker.ubatching", dbo_current_ubatch_id=lambda: 0)
    # kernels.py (fused_q) and the DSA Top-K modules
    for pkg in (
        "vllm.models",
        "vllm.models.deepseek_v32",
        "vllm.models.deepseek_v32.common",
        "vllm.model_executor.kernels",
        "vllm.model_executor.kernels.attention",
        "vllm.model_executor.kernels.attention.dsa",
    ):
        _stub(pkg)
    _stub("vllm.platforms", current_platform=_Platform())
    _stub("vllm.utils")
    _stub("vllm.utils.deep_gemm", mqa_logits_use_mx_scales=_never)
    _stub("vllm.v1.attention.ops.common", pack_ue8m0_x4=_never)
    _stub("vllm.v1.kv_cache_interface", is_quantized_kv_cache=_never)
    _stub("vllm.distributed.parallel_state", GroupCoordinator=_Placeholder, get_dcp_group=_never)


class _Platform:
    """Stand-in for ``vllm.platforms.current_platform``, with the answers vLLM gives on NVIDIA hardware except
    ``is_cuda``: False keeps ``fused_q`` on its Triton kernel (on CUDA vLLM first tries ``fused_q_cutedsl``,
    a CuTeDSL kernel that needs nvidia-cutlass-dsl; see :data:`QUERY_PEERS`)."""

    @staticmethod
    def fp8_dtype():
        import torch

        return torch.float8_e4m3fn

    @staticmethod
    def is_cuda() -> bool:
        return False

    @staticmethod
    def is_arch_support_pdl() -> bool:  # vLLM: compute capability 9.0 or newer
        import torch

        return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def load_vllm_file(rel: str, extra_stubs: dict[str, dict] | None = None) -> tuple[types.ModuleType | None, str]:
    """One file of vLLM's wheel, extracted under ``ROOT``, as module ``rel`` (dots), or ``(None, why)``.

    ``extra_stubs`` are stand-in modules registered only while the file executes (then removed from
    ``sys.modules`` again, so that nothing else in the process sees them), for third-party packages whose
    names the file binds at module level but whose code the loaded kernels never run.
    """
    name = rel.removesuffix(".py").replace("/", ".")
    if name in _cache:
        return _cache[name]
    path = ROOT / rel
    res: tuple[types.ModuleType | None, str]
    if not path.is_file():
        res = (None, f"vllm {VLLM_VERSION} not extracted ({path} missing; run scripts/setup_peers.sh)")
        _cache[name] = res
        return res
    added: list[str] = []
    try:
        _install_vllm_stubs()
        for mod_name, attrs in (extra_stubs or {}).items():
            if mod_name not in sys.modules:
                _stub(mod_name, **attrs)
                added.append(mod_name)
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        res = (mod, f"vllm {VLLM_VERSION} {rel} from {ROOT}")
    except Exception as e:  # noqa: BLE001 - any load failure is a reason to report
        sys.modules.pop(name, None)
        res = (None, f"vllm {VLLM_VERSION} {rel} does not load: {type(e).__name__}: {e}")
    finally:
        for mod_name in added:
            sys.modules.pop(mod_name, None)
    _cache[name] = res
    return res


def load_vllm_dcp() -> tuple[types.ModuleType | None, str]:
    """vLLM's ``vllm.v1.attention.ops.dcp`` module, or ``(None, why)``.

    The real package is used when it imports (a full vLLM install); otherwise the file extracted under ``ROOT``
    with the stand-ins of :func:`_install_vllm_stubs`.
    """
    if "vllm_dcp" in _cache:
        return _cache["vllm_dcp"]
    res: tuple[types.ModuleType | None, str]
    # (checked before find_spec: a stand-in "vllm" registered by another loader has no __spec__)
    if "vllm" not in sys.modules and importlib.util.find_spec("vllm") is not None:
        try:
            import vllm.v1.attention.ops.dcp as mod  # a real install

            res = (mod, f"vllm {getattr(sys.modules['vllm'], '__version__', '?')} (installed)")
        except Exception as e:  # noqa: BLE001 - any import failure is a reason to report
            res = (None, f"installed vllm does not import its dcp module: {type(e).__name__}: {e}")
        _cache["vllm_dcp"] = res
        return res
    path = ROOT / _VLLM_DCP
    if not path.is_file():
        res = (None, f"vllm {VLLM_VERSION} not extracted ({path} missing; run scripts/setup_peers.sh)")
    else:
        try:
            _install_vllm_stubs()
            spec = importlib.util.spec_from_file_location("vllm.v1.attention.ops.dcp", path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = mod
            spec.loader.exec_module(mod)
            res = (mod, f"vllm {VLLM_VERSION} dcp.py from {ROOT} (a2a kernels only; ag_rs needs vLLM's runtime)")
        except Exception as e:  # noqa: BLE001
            sys.modules.pop("vllm.v1.attention.ops.dcp", None)
            res = (None, f"vllm {VLLM_VERSION} dcp.py does not load: {type(e).__name__}: {e}")
    _cache["vllm_dcp"] = res
    return res


def vllm_a2a_rank(mod: types.ModuleType, sends_to_me, head_dim: int, out=None):
    """Rank-local half of vLLM's a2a after the exchange: ``_dcp_a2a_unpack_combine`` of the received buffer.

    Args:
        sends_to_me: ``[W, T, H/W, D + P]`` what each source rank packed for this rank (P = 2 for 16-bit outputs).
    Returns: ``(out [T, H/W, D], lse [T, H/W] fp32)``, natural-log LSE.
    """
    pack = mod._dcp_a2a_lse_pack_dim(sends_to_me.dtype)
    return mod._dcp_a2a_unpack_combine(sends_to_me, head_dim, pack, True, True, out)


def vllm_a2a_pack(mod: types.ModuleType, out, lse, world_size: int):
    """vLLM's ``_dcp_a2a_pack_send``: ``out [T, H, D]`` bf16/fp16 + ``lse [T, H]`` -> send ``[W, T, H/W, D + P]``."""
    import torch

    T, H, D = out.shape
    if H % world_size:
        raise ValueError(f"H={H} must be divisible by world_size={world_size}")
    pack = mod._dcp_a2a_lse_pack_dim(out.dtype)
    send = torch.empty((world_size, T, H // world_size, D + pack), device=out.device, dtype=out.dtype)
    mod._dcp_a2a_pack_send(out, lse, send, world_size, H // world_size, D, pack)
    return send


_AG_RS_WHY = (
    "cp_lse_ag_out_rs = NCCL all-gather of the LSEs + CorrectAttnCPOutKernel + reduce-scatter needs no compiled op; "
    "its Triton kernel runs here (check_vllm_ag_rs, launched directly), but the function itself launches through "
    "vLLM's JIT-warmup runtime (VllmTritonJitKernel, kernel_launcher, CPTritonContext) on a vllm.distributed "
    "GroupCoordinator, which the stand-ins do not provide: checked, not timed in bench.output"
)
_DIRECT_WHY = (
    "DirectDCPA2AWorkspace.lse_reduce calls torch.ops._C.direct_dcp_a2a_lse_reduce, registered by "
    "vllm/_C_stable_libtorch.abi3.so (88.7 MB, more than the 64 MiB carry; built against torch 2.14.0, "
    "which vllm 0.34.0 pins, and a stable-ABI extension loads only into the torch it was built for or a "
    "newer one: not torch 2.11 or 2.13)"
)
_FLASHINFER_WHY = (
    f"flashinfer-python {FLASHINFER_VERSION} holds decode_cp_a2a_lse_reduce (flashinfer/comm/"
    "dcp_lse_reduce.py, csrc/dcp_lse_reduce.cu): it JIT-builds with nvcc for SM90+ against torch's "
    "c10d NCCL symmetric-memory headers (symm_mem/nccl_dev_cap.hpp, nccl_devcomm_manager.hpp) and "
    "NCCL's device API (ncclDevCommCreate; 'requires NCCL >= 2.29 with device communicator "
    "support'), needs a cooperative launch and one NVLink (LSA) domain, and imports the whole "
    "flashinfer package (101 MB wheel, 715 MB extracted; apache-tvm-ffi, nvidia-cutlass-dsl, "
    "nccl4py): more than the 64 MiB carry, so not on the offline GPU machine"
)


def status() -> list[tuple[str, bool, str]]:
    """``(peer, loadable, reason)`` for every Output peer of issue 54, for a benchmark's header."""
    mod, why = load_vllm_dcp()
    return [
        ("vllm-a2a", mod is not None, why),
        ("vllm-ag_rs", mod is not None, _AG_RS_WHY if mod is not None else why),
        ("vllm-direct", False, _DIRECT_WHY),
        ("flashinfer-a2a", False, _FLASHINFER_WHY),
    ]


def check_vllm_a2a(device: str, world: int = 2, T: int = 4, H: int = 8, D: int = 512) -> tuple[bool | None, str]:
    """vLLM's a2a pack + combine for ``world`` simulated ranks on ``device`` against peerdcp's fp32 bound.

    Returns ``(True, detail)`` inside the bound on every rank, ``(False, detail)`` for a different answer (the
    benchmark reports it and does not time it), ``(None, why)`` when the peer does not load.
    """
    import torch

    from peerdcp.output import reference as ref

    mod, why = load_vllm_dcp()
    if mod is None:
        return None, why
    g = torch.Generator().manual_seed(54)
    outs = [torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(world)]
    lses = [(3 * torch.randn(T, H, generator=g)).to(device) for _ in range(world)]
    sends = [vllm_a2a_pack(mod, outs[s], lses[s], world) for s in range(world)]
    n_bad, n, err = 0, 0, 0.0
    for r in range(world):
        got = torch.full((T, H // world, D), float("nan"), dtype=torch.bfloat16, device=device)
        got, _ = vllm_a2a_rank(mod, torch.stack([sends[s][r] for s in range(world)]), D, out=got)
        lo, hi, _, _ = ref.dcp_reduce_bounds([o.cpu() for o in outs], [x.cpu() for x in lses], r)
        n_bad += int(ref.outside_bounds(got.cpu(), lo, hi).sum())
        n += got.numel()
        want = ref.combine(*ref.rank_sources([o.cpu() for o in outs], [x.cpu() for x in lses], r))
        err = max(err, float((got.cpu().double() - want).abs().max()))
    detail = f"W={world} T={T} H={H} D={D}: {n_bad}/{n} outside peerdcp's fp32 bound, max |err| {err:.4g}"
    return n_bad == 0, detail


def vllm_ag_rs_correct(mod: types.ModuleType, out, lses, rank: int):
    """vLLM's ``CorrectAttnCPOutKernel`` (the middle of ``cp_lse_ag_out_rs``) for one rank: ``out [T, H, D]`` this
    rank's partial output, ``lses [W, T, H]`` every rank's LSE (the all-gather) -> ``(out weighted by
    exp(lse_rank - lse), lse)``, in ``out``'s dtype. Launched directly with the grid and constexprs of vLLM's
    ``__call__`` (``(T, H, 1)``, N_ROUNDED = the gathered count); vLLM's JIT-warmup launcher is not loaded."""
    import torch

    T, H, D = out.shape
    new = torch.empty_like(out)
    lse = torch.empty_strided((T, H), lses.stride()[1:], dtype=lses.dtype, device=lses.device)
    mod.CorrectAttnCPOutKernel.kernel[(T, H, 1)](
        out, new, lses, lse, *out.stride(), *lses.stride(), rank,
        HEAD_DIM=D, N_ROUNDED=lses.shape[0], IS_BASE_E=True,
    )  # fmt: skip
    return new, lse


def check_vllm_ag_rs(device: str, world: int = 2, T: int = 4, H: int = 8, D: int = 512) -> tuple[bool | None, str]:
    """vLLM's ag_rs for ``world`` simulated ranks: the correction kernel on every rank, then the reduce-scatter's
    sum in bf16 (each hop of NCCL's bf16 sum rounds to bf16; ranks added in rank order), against peerdcp's fp32
    bound. Returns as :func:`check_vllm_a2a`."""
    import torch

    from peerdcp.output import reference as ref

    mod, why = load_vllm_dcp()
    if mod is None:
        return None, why
    g = torch.Generator().manual_seed(55)
    outs = [torch.randn(T, H, D, generator=g).to(torch.bfloat16).to(device) for _ in range(world)]
    lses = [(3 * torch.randn(T, H, generator=g)).to(device) for _ in range(world)]
    gathered = torch.stack(lses)
    corrected = [vllm_ag_rs_correct(mod, outs[r], gathered, r)[0] for r in range(world)]
    total = corrected[0]
    for c in corrected[1:]:
        total = (total.float() + c.float()).to(torch.bfloat16)
    n_bad, n, err, h = 0, 0, 0.0, H // world
    for r in range(world):
        got = total[:, r * h : (r + 1) * h].cpu()
        lo, hi, _, _ = ref.dcp_reduce_bounds([o.cpu() for o in outs], [x.cpu() for x in lses], r)
        n_bad += int(ref.outside_bounds(got, lo, hi).sum())
        n += got.numel()
        want = ref.combine(*ref.rank_sources([o.cpu() for o in outs], [x.cpu() for x in lses], r))
        err = max(err, float((got.double() - want).abs().max()))
    detail = f"W={world} T={T} H={H} D={D}: {n_bad}/{n} outside peerdcp's fp32 bound, max |err| {err:.4g}"
    return n_bad == 0, detail


def report_lines(device: str | None = None) -> list[str]:
    """One line per peer for a benchmark's report: loaded, checked (when ``device``), or skipped and why."""
    lines = []
    for name, ok, why in status():
        if name in ("vllm-a2a", "vllm-ag_rs") and ok and device is not None:
            res, detail = (check_vllm_a2a if name == "vllm-a2a" else check_vllm_ag_rs)(device)
            verdict = "correct" if res else "DIFFERENT ANSWER, not timed"
            lines.append(f"peer {name}: {verdict} ({detail})")
        else:
            lines.append(f"peer {name}: {'loaded' if ok else 'skipped'}: {why}")
    return lines


QUERY_PEERS = [
    (
        "vllm-fused_q-cutedsl",
        "fused_q_cutedsl (vllm/models/deepseek_v32/nvidia/ops/fused_q_cutedsl.py, which vLLM "
        "tries first on CUDA): CuTeDSL, needs nvidia-cutlass-dsl (its libs wheel alone is 92 MB, more than the 64 MiB "
        "carry); the Triton fused_q it falls back to is the peer timed",
    ),
    (
        "vllm-direct-q",
        "DirectDCPQGatherWorkspace: torch.ops._C.direct_dcp_q_gather (vllm/_C_stable_libtorch.abi3.so, "
        "torch 2.14.0) over NVLink multicast, which stays off here",
    ),
]
"""The Query peers that never run here, with the reason (``bench.peers.fused_q`` is the one that does)."""

TOPK_PEERS = [
    (
        "vllm-topk-ag",
        "pack_dcp_topk_candidates_cutedsl (Triton: runs, checked by bench.peers.topk) + NCCL all-gather "
        "+ stable_topk_from_gathered_candidates_cutedsl: the select is CuTeDSL (nvidia-cutlass-dsl 4.8 + quack-kernels "
        "0.6.5 + cuda-bindings, compiled through the CUDA driver; the libs wheel alone is 92 MB, more than the 64 MiB "
        "carry): no vLLM ids to check or time",
    ),
    (
        "vllm-topk-direct",
        "DirectDCPTopKWorkspace.merge: pack + _push_candidates_kernel (Triton: run, checked by "
        "bench.peers.topk) + _publish_and_wait_kernel (PTX trap in inline asm: GPU only; its inboxes need a "
        "symmetric-memory rendezvous, vllm.v1.attention.ops.cp_common.DirectCPWorkspace) + "
        "stable_topk_from_pingpong_candidates_cutedsl (CuTeDSL, as above): no vLLM ids to check or time",
    ),
]
"""The Top-K peers, skipped in bench.topk with the reason: their selects need CuTeDSL."""


def query_lines(device: str | None = None) -> list[str]:
    """bench.query's peer lines: fused_q checked on ``device`` (BF16 and FP8, 2 simulated ranks) or skipped."""
    import torch

    from bench.peers import fused_q

    lines = []
    mod, why = fused_q.load()
    if mod is None:
        lines.append(f"peer {fused_q.NAME}: skipped: {why}")
    elif device is None:
        lines.append(f"peer {fused_q.NAME}: loaded: {why}")
    else:
        for dt in (torch.bfloat16, torch.float8_e4m3fn):
            ok, detail = fused_q.check(device, out_dtype=dt)
            verdict = "matches" if ok else "DIFFERENT ANSWER, not timed"
            lines.append(f"peer {fused_q.NAME}: {verdict} ({detail})")
    return lines + [f"peer {n}: skipped: {w}" for n, w in QUERY_PEERS]


def topk_lines(device: str | None = None) -> list[str]:
    """bench.topk's peer lines: the pack / push checks on ``device`` (when given), then the skipped selects."""
    lines = []
    if device is not None:
        from bench.peers import topk

        for name, ok, detail in topk.check(device, rows=4, L=3 * 2048, k=2048):
            state = "skipped" if ok is None else "ran, matches" if ok else "ran, DIFFERENT"
            lines.append(f"peer {name}: {state}: {detail}")
    return lines + [f"peer {n}: skipped: {w}" for n, w in TOPK_PEERS]
