"""Functions run on every rank by tests/test_query_host.py and tests/test_query_gpu.py (module-level so
spawn can pickle them). Every rank builds *every* rank's inputs from the same seed, so each rank can
compute the full reference locally and compare without any extra communication."""

from __future__ import annotations

import dataclasses
import glob
import os
import random
import time

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from peerdcp._runtime.device import f32_to_bf16_bits
from peerdcp.errors import PeerSetupError, PeerTimeoutError
from peerdcp.query import QueryGather, widened_query, widened_query_bounds
from peerdcp.query import kernels as K
from peerdcp.query.policy import QueryPolicy, default_policy
from peerdcp.query.rope import cos_sin_cache, plain_cos_sin_cache
from peerdcp.query.rows import _f32_to_e4m3_bits

FP8 = torch.float8_e4m3fn
BF16 = torch.bfloat16


# ------------------------------------------------------------------------------------------ helpers
def _dev() -> torch.device:
    if dist.get_backend() != "gloo" and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def make_inputs(
    seed: int,
    W: int,
    T: int,
    H: int,
    nope: int,
    rope: int,
    max_pos: int,
    *,
    mag: float = 1.0,
    device="cpu",
    specials: bool = False,
):
    """Every rank's ``q_nope [T, H, nope]`` / ``q_pe [T, H, rope]`` (bf16) and positions (spread over the
    whole table, both ends included when T >= 2), identical on every rank for the same seed."""
    g = torch.Generator().manual_seed(seed)
    nopes = [(torch.randn(T, H, nope, generator=g) * mag).to(BF16) for _ in range(W)]
    pes = [(torch.randn(T, H, rope, generator=g) * mag).to(BF16) for _ in range(W)]
    if specials:  # saturation: values far beyond 448 / scale, and +-inf in the nope part (RoPE of an
        # infinite pe element is inf - inf = NaN in exact math too, so pe gets huge finite values)
        for x in nopes:
            x.view(-1)[:3] = torch.tensor([float("inf"), float("-inf"), 1e30])
        for x in pes:
            x.view(-1)[:3] = torch.tensor([1e30, -1e30, 3e5])
    pos = torch.randint(0, max_pos, (T,), generator=g, dtype=torch.int64)
    if T >= 2:
        pos[0], pos[-1] = 0, max_pos - 1
    return [n.to(device) for n in nopes], [p.to(device) for p in pes], pos.to(device)


def ordered(x: torch.Tensor) -> torch.Tensor:
    """Map fp8 e4m3 / bf16 values to integers on which adjacent representable values differ by 1
    (+0 and -0 both map to 0), so |a - b| is the distance in output steps."""
    if x.dtype == FP8:
        b = x.view(torch.uint8).to(torch.int32)
        mag, neg = b & 0x7F, (b & 0x80) != 0
    else:
        b = x.view(torch.int16).to(torch.int32) & 0xFFFF
        mag, neg = b & 0x7FFF, (b & 0x8000) != 0
    return torch.where(neg, -mag, mag)


def compare(q: torch.Tensor, ref32: torch.Tensor, ref64: tuple) -> dict:
    """Bitwise equality with the fp32 reference; against the fp64 math ``ref64 = (value, lo, hi)``
    (:func:`references`): elements outside ``[lo, hi]`` (the rounding contract's error bound), the largest
    distance in steps and the share identical (both informative: cancellation can put a correct fp32
    result many steps from the fp64 value, within the bound), NaNs."""
    qc, r32 = q.cpu(), ref32.cpu()
    r64, lo, hi = (x.cpu() for x in ref64)
    bits = torch.uint8 if q.dtype == FP8 else torch.int16
    oq = ordered(qc)
    d = (oq - ordered(r64)).abs()
    return {
        "bitwise_fp32": bool(torch.equal(qc.view(bits), r32.view(bits))),
        "outside_fp64_bound": int(((oq < ordered(lo)) | (oq > ordered(hi))).sum()),
        "max_steps_fp64": int(d.max()) if d.numel() else 0,
        "identical_fp64": float((d == 0).float().mean()) if d.numel() else 1.0,
        "nan": int(qc.float().isnan().sum()),
        "shape": list(q.shape),
    }


def references(nopes, pes, pos, cs, *, style, out_dtype, scale, pad):
    """The fp32 reference (the contract, bitwise) and ``(fp64 value, lo, hi)``: the true math and the
    interval its rounding bound allows (:func:`peerdcp.query.reference.widened_query_bounds`)."""
    kw = dict(rope_style=style, out_dtype=out_dtype, quant_scale=scale, pad_heads_to=pad)
    cpu = [x.cpu() for x in nopes], [x.cpu() for x in pes]
    r32 = widened_query(*cpu, pos.cpu(), cs.cpu(), **kw)
    r64 = widened_query(*cpu, pos.cpu(), cs.cpu(), compute_dtype=torch.float64, **kw)
    return r32, (r64, *widened_query_bounds(*cpu, pos.cpu(), cs.cpu(), **kw))


def poisoned(qg: QueryGather, T: int) -> torch.Tensor:
    """An output buffer full of NaN codes (0xFF bytes), so an element the kernel skips shows up."""
    out = torch.empty((T, qg.out_heads, qg.head_dim), dtype=qg.out_dtype, device=qg.device)
    out.view(torch.uint8).fill_(0xFF)
    return out


def _table(name: str, rope: int, device) -> torch.Tensor:
    if name == "plain":
        return plain_cos_sin_cache(4096, rope, device=device)
    return cos_sin_cache(name, device=device)


# ------------------------------------------------------------------------------------- numerics
@triton.jit
def _cvt_kernel(x, y8, yb, N: tl.constexpr):
    o = tl.arange(0, N)
    v = tl.load(x + o)
    tl.store(y8 + o, _f32_to_e4m3_bits(v).to(tl.uint8))
    tl.store(yb + o, f32_to_bf16_bits(v).to(tl.int16))


def kernel_numerics() -> dict:
    """The interpreter's fp32 -> e4m3 / bf16 bit conversions against torch, over every e4m3 value and
    midpoint (ties), every bf16 midpoint in [0.5, 4), random magnitudes and random bit patterns."""
    b8 = torch.arange(0, 127, dtype=torch.uint8).view(FP8).float()
    bb = torch.arange(0x3F00, 0x4080, dtype=torch.int32).to(torch.int16).view(BF16).float()
    special = torch.tensor([448.0, 449.0, 464.0, 465.0, 1e6, float("inf"), 0.0, -0.0, 2.0**-10, 2.0**-9 * 1.5])
    g = torch.Generator().manual_seed(7)
    parts = [
        b8,
        (b8[:-1] + b8[1:]) / 2,
        bb,
        (bb[:-1] + bb[1:]) / 2,
        special,
        torch.randn(4096, generator=g) * 100,
        torch.randn(4096, generator=g) * 1e-3,
        torch.randint(-(2**31), 2**31 - 1, (4096,), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32),
        # NaNs whose payload is only in the low 16 bits: a plain truncation to bf16 would make them +-inf
        torch.tensor([0x7F800001, 0x7F80FFFF, 0x7F808000], dtype=torch.int32).view(torch.float32),
    ]
    x = torch.cat([torch.cat(parts), -torch.cat(parts)])
    n = triton.next_power_of_2(x.numel())
    x = torch.cat([x, torch.zeros(n - x.numel())])
    y8 = torch.empty(n, dtype=torch.uint8)
    yb = torch.empty(n, dtype=torch.int16)
    _cvt_kernel[(1,)](x, y8, yb, n)
    nan = x.isnan()
    ref8 = x.clamp(-448, 448).to(FP8).view(torch.uint8)
    refb = x.to(BF16).view(torch.int16)
    return {
        "n": n,
        "fp8_mismatch": int(((y8 != ref8) & ~nan).sum()),
        "bf16_mismatch": int(((yb != refb) & ~nan).sum()),
        "fp8_nan_is_nan": bool(((y8[nan] & 0x7F) == 0x7F).all()),
        "bf16_nan_is_nan": bool(yb[nan].view(BF16).isnan().all()),
    }


# ------------------------------------------------------------------------------- the gather matrix
def case_setup(case: dict, seed: int, T: int = 5, H: int = 3) -> tuple:
    """A matrix case's inputs on this rank's device, its fp32/fp64 references, and the QueryGather keyword
    arguments every path of the case shares: ``(T, nopes, pes, pos, cs, r32, r64, common)``, ``r64`` the
    ``(value, lo, hi)`` of :func:`references`."""
    W, dev = dist.get_world_size(), _dev()
    nope, rope = case.get("nope", 512), case.get("rope", 64)
    style, out_dtype, scale, pad = case["style"], case["out"], case.get("scale", 1.0), case.get("pad")
    Tc, Hc = case.get("T", T), case.get("H", H)
    cs = _table(case.get("table", "plain"), rope, dev)
    nopes, pes, pos = make_inputs(
        seed,
        W,
        Tc,
        Hc,
        nope,
        rope,
        cs.shape[0],
        mag=case.get("mag", 1.0),
        device=dev,
        specials=case.get("specials", False),
    )
    if case.get("oob"):  # positions outside the table (GPU only: CPU positions are checked, these raise there):
        # every kernel clamps them into the table, as the reference does
        n = cs.shape[0]
        pos = pos.clone()
        pos[0], pos[Tc // 2], pos[-1] = -7, n, n + 100_000
    if case.get("pos32"):
        pos = pos.to(torch.int32)
    r32, r64 = references(nopes, pes, pos, cs, style=style, out_dtype=out_dtype, scale=scale, pad=pad)
    common = dict(
        max_tokens=Tc + 2,
        heads_per_rank=Hc,
        nope_dim=nope,
        rope_dim=rope,
        rope_style=style,
        out_dtype=out_dtype,
        quant_scale=scale,
        pad_heads_to=pad,
        device=dev,
    )
    return Tc, nopes, pes, pos, cs, r32, r64, common


# The push exchange's protocols of the CUDA kernel, each forced for every T of these cases by its QueryPolicy
# bounds (changes to the default policy): LL, SN (the sentinel push, FP8 only: BF16 cases fall through to the
# fenced push / roped), LL12, LL128 and the fenced plain push.
_ALL = 1 << 40
_OFF = {"cuda_ll_max_bytes": 0, "cuda_ll12_max_bytes": 0, "cuda_ll128_max_bytes": 0, "cuda_sn_max_bytes": 0}
CUDA_SN = dict(_OFF, cuda_sn_max_bytes=_ALL, cuda_sn_wide_min_bytes=_ALL)  # SN with 8-byte stores at every T
CUDA_PUSH = {
    "push": {"cuda_ll_max_bytes": _ALL},
    "push_ll12": dict(_OFF, cuda_ll12_max_bytes=_ALL),
    "push_ll128": dict(_OFF, cuda_ll128_max_bytes=_ALL),
    "push_sn": CUDA_SN,
    "push_sn16": dict(_OFF, cuda_sn_max_bytes=_ALL, cuda_sn_wide_min_bytes=0),  # 16-byte (interleaved RoPE)
    # SN with the call's grid cut to ceil(T * H / 3) blocks, no floor (the default: / 2, at least one per SM);
    # the object's whole grid
    "push_sn_u3": dict(CUDA_SN, cuda_sn_units_per_block=3, cuda_sn_min_blocks_per_sm=0),
    "push_sn_whole": dict(CUDA_SN, cuda_sn_units_per_block=0),
    "push_plain": _OFF,
}


def policy(changes: dict | None = None) -> QueryPolicy:
    """The default policy with ``changes`` (QueryPolicy field -> value), e.g. one of :data:`CUDA_PUSH`."""
    return dataclasses.replace(default_policy(), **(changes or {}))


def direct_paths(impl: str) -> list[str]:
    """The direct paths :func:`gather_matrix` runs for ``impl`` (exposed = zero-copy)."""
    return ["raw", "roped", *(CUDA_PUSH if impl == "cuda" else ["push"]), "exposed"]


def gather_matrix(cases: list[dict], H: int = 3, T: int = 5, memory: str = "auto", impls=("triton",)) -> list:
    """For each case, run every path on the same inputs; return per-path comparisons.

    Paths: direct raw / roped / push / exposed (zero-copy) for each direct impl (CUDA: push with each of its
    protocols, :data:`CUDA_PUSH`), allgather fused (triton) and allgather torch. Each is compared bitwise
    with the fp32 reference and bounded by the fp64 one.
    """
    dev = _dev()
    results = []
    for ci, case in enumerate(cases):
        Tc, nopes, pes, pos, cs, r32, r64, common = case_setup(case, 1000 + ci, T, H)
        me, out_dtype = dist.get_rank(), case["out"]
        outs = {}
        for impl in impls:
            for path in direct_paths(impl):
                if path == "exposed":
                    continue  # with the raw object below
                ex = "push" if path.startswith("push") else path
                pol = policy(CUDA_PUSH.get(path))
                qg = QueryGather(backend="direct", memory=memory, exchange=ex, impl=impl, **common, policy=pol)
                with qg:
                    out = poisoned(qg, Tc)
                    outs[f"direct-{impl}-{path}"] = qg.gather(nopes[me], pes[me], pos, cs, out=out)
                    if ex == "raw":
                        zn, zp = qg.exposed_shard(Tc)
                        zn.copy_(nopes[me])
                        zp.copy_(pes[me])
                        outs[f"direct-{impl}-exposed"] = qg.gather_exposed(pos, cs, out=poisoned(qg, Tc))
                        meta = (qg.backend, qg.memory, qg.impl)
        for impl in ("triton", "torch"):
            with QueryGather(backend="allgather", impl=impl, **common) as qg:
                outs[f"allgather-{impl}"] = qg.gather(nopes[me], pes[me], pos, cs, out=poisoned(qg, Tc))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        first = next(iter(outs.values()))
        bits = torch.uint8 if out_dtype == FP8 else torch.int16
        res = {
            "case": ci,
            "meta": meta,
            "all_equal": all(torch.equal(o.view(bits).cpu(), first.view(bits).cpu()) for o in outs.values()),
            "paths": {k: compare(o, r32, r64) for k, o in outs.items()},
        }
        if case.get("specials"):
            f = first.float().cpu()
            res["saturated"] = bool((f.abs() <= 448).all() and (f.abs() == 448).any())
        results.append(res)
    return results


def one_path(case: dict, impl: str, exchange: str, memory: str, timeout_s: float = 5.0) -> dict:
    """One path (``exchange`` raw | roped | push | exposed, or ``allgather`` with impl triton | torch) of
    :func:`gather_matrix` alone, with a short
    peer timeout: bitwise equality with the fp32 reference, the seconds it took, and any error (so a
    path that stalls is named, instead of a whole matrix running into the test's timeout)."""
    T, nopes, pes, pos, cs, r32, _, common = case_setup(case, 2000 + case["T"])
    me = dist.get_rank()
    t0 = time.perf_counter()
    err = None
    ok = False
    try:
        if exchange == "allgather":  # impl triton | torch
            ctx = QueryGather(backend="allgather", impl=impl, **common)
        else:
            ex = "raw" if exchange == "exposed" else exchange
            ctx = QueryGather(backend="direct", memory=memory, exchange=ex, impl=impl, timeout_s=timeout_s, **common)
        with ctx as qg:
            if exchange == "exposed":
                zn, zp = qg.exposed_shard(T)
                zn.copy_(nopes[me])
                zp.copy_(pes[me])
                out = qg.gather_exposed(pos, cs, out=poisoned(qg, T))
            else:
                out = qg.gather(nopes[me], pes[me], pos, cs, out=poisoned(qg, T))
            qg.check()
            bits = torch.uint8 if case["out"] == FP8 else torch.int16
            ok = bool(torch.equal(out.cpu().view(bits), r32.view(bits)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        err = f"{type(e).__name__}: {e}"
    return {"ok": ok, "error": err, "seconds": round(time.perf_counter() - t0, 3)}


def check_matrix(results: list, names: list[str], memory: str, impls=("triton",)) -> None:
    """The assertions the tests make on :func:`gather_matrix` results (shared by CPU and GPU tests)."""
    for name, res in zip(names, results):
        assert res["meta"][0] == "direct" and res["meta"][1] == memory, (name, res["meta"])
        assert res["all_equal"], (name, {k: v["bitwise_fp32"] for k, v in res["paths"].items()})
        for path, c in res["paths"].items():
            assert c["bitwise_fp32"], (name, path, c)
            assert c["outside_fp64_bound"] == 0, (name, path, c)
            assert c["identical_fp64"] >= 0.999, (name, path, c)
            assert c["nan"] == 0, (name, path, c)
        if "saturated" in res:
            assert res["saturated"], name
        want = {f"direct-{i}-{m}" for i in impls for m in direct_paths(i)}
        assert set(res["paths"]) == want | {"allgather-triton", "allgather-torch"}, (name, sorted(res["paths"]))


def _wide(qg, T: int) -> bool:
    """Whether a copy call of T tokens on ``qg`` is a sentinel push with 16-byte stores (the launch's wide bit)."""
    return qg._copy_mode(T) == K.MODE_PUSH_SN and qg._plan.sn_wide_min is not None and qg._plan.sn_wide_min < T


def _mode_name(qg, T: int, names: dict) -> str:
    return names[qg._copy_mode(T)] + ("16" if _wide(qg, T) else "")


# ---------------------------------------------------------------------------------- back to back
def back_to_back(
    n_calls: int,
    H: int = 2,
    max_T: int = 7,
    impl: str = "triton",
    memory: str = "auto",
    raw_max: int | None = None,
    ll_max: int | None = None,
    out_dtype: torch.dtype = FP8,
    ll128_max: int | None = None,
    ll12_max: int | None = None,
    sn_max: int | None = None,
    sn_wide_min: int | None = None,
    tuning: dict | None = None,
) -> dict:
    """``n_calls`` calls with changing T, inputs and positions, copy and zero-copy mixed, no barrier and
    no host synchronization between them; every output checked at the end. ``raw_max`` overrides
    ``QueryPolicy.auto_push_raw_max_tokens`` (so small T mix the raw and push exchanges in one object's parity slots);
    ``ll_max`` sets the CUDA LL bound to that many tokens (``QueryPolicy.cuda_ll_max_bytes``, rows of nope 512
    + rope 64), ``sn_max`` / ``ll12_max`` / ``ll128_max`` the SN / LL12 / LL128 bounds likewise, and
    ``sn_wide_min`` the SN calls' 16-byte-store bound (``push_sn16`` above it); ``modes`` names the exchanges
    used; ``tuning`` changes any other QueryPolicy fields."""
    row = H * 576 * out_dtype.itemsize
    bounds = {"cuda_ll_max_bytes": ll_max, "cuda_ll12_max_bytes": ll12_max, "cuda_ll128_max_bytes": ll128_max}
    bounds["cuda_sn_max_bytes"] = sn_max
    bounds["cuda_sn_wide_min_bytes"] = sn_wide_min
    changes = dict(tuning or {})
    if raw_max is not None:
        changes["auto_push_raw_max_tokens"] = raw_max
    changes.update({k: b * row for k, b in bounds.items() if b is not None})
    W, me, dev = dist.get_world_size(), dist.get_rank(), _dev()
    cs = cos_sin_cache("deepseek-v3.2", device=dev)
    g = torch.Generator().manual_seed(99)
    # zero-copy every third call, and runs of two or three (i % 8 in 5..7): the caller's writes into slot Z of call
    # e + 1 follow call e at once, so only the ack wait keeps a slower peer's reads of call e from seeing them
    plan = [(int(torch.randint(1, max_T + 1, (1,), generator=g)), i % 3 == 2 or i % 8 >= 5) for i in range(n_calls)]
    kept = []
    with QueryGather(
        max_tokens=max_T,
        heads_per_rank=H,
        backend="direct",
        memory=memory,
        impl=impl,
        exchange="auto",
        out_dtype=out_dtype,
        pad_heads_to=64 if W * H <= 64 else None,
        device=dev,
        policy=policy(changes),
    ) as qg:
        info = {"backend": qg.backend, "memory": qg.memory, "impl": qg.impl, "nprog": qg.num_programs}
        names = {K.MODE_RAW: "raw", K.MODE_ROPED: "roped", K.MODE_PUSH: "push", K.MODE_PUSH_LL: "push_ll"}
        names.update({K.MODE_PUSH_LL128: "push_ll128", K.MODE_PUSH_LL12: "push_ll12", K.MODE_PUSH_SN: "push_sn"})
        info["modes"] = sorted({"exposed" if e else _mode_name(qg, T, names) for T, e in plan})
        # inputs made before the loop, and a random pause on some calls (its own per rank): back-to-back calls
        # with the ranks drifting apart, so a rank can start call e + 1 while a peer still reads call e
        inputs = [make_inputs(5000 + i, W, T, H, 512, 64, cs.shape[0], device=dev) for i, (T, _) in enumerate(plan)]
        outs = [poisoned(qg, T) for T, _ in plan]
        jitter = random.Random(4321 + me)
        t0 = time.perf_counter()
        per_call = []  # host seconds of each call (launched): where a slow test spends its time
        for i, (T, exposed) in enumerate(plan):
            if jitter.random() < 0.3:
                time.sleep(jitter.random() * 0.01)
            tc = time.perf_counter()
            nopes, pes, pos = inputs[i]
            out = outs[i]
            if exposed:
                zn, zp = qg.exposed_shard(T)
                zn.copy_(nopes[me])
                zp.copy_(pes[me])
                qg.gather_exposed(pos, cs, out=out)
            else:
                qg.gather(nopes[me], pes[me], pos, cs, out=out)
            kept.append(out)
            per_call.append((time.perf_counter() - tc, i, T, exposed))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        qg.check()
    t1 = time.perf_counter()
    bad, cs_cpu = [], cs.cpu()
    for i, ((T, exposed), out) in enumerate(zip(plan, kept)):
        nopes, pes, pos = make_inputs(5000 + i, W, T, H, 512, 64, cs.shape[0])
        ref = widened_query(nopes, pes, pos, cs_cpu, out_dtype=out_dtype, pad_heads_to=out.shape[1])
        if not torch.equal(out.cpu().view(torch.uint8), ref.view(torch.uint8)):
            bad.append((i, T, exposed))
    info.update(calls=n_calls, bad=bad, tokens=sorted({T for T, _ in plan}), exposed=sum(e for _, e in plan))
    info.update(t_calls_s=t1 - t0, t_check_s=time.perf_counter() - t1, slowest_calls=sorted(per_call)[-4:])
    return info


# ------------------------------------------------------------------------------------- bad input
def _err(fn) -> str:
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 - reported, the test fails on it
        return f"UNEXPECTED {type(e).__name__}: {e}"
    return "no error"


def bad_inputs() -> dict:
    """Every bad argument raises ValueError/TypeError before any launch or peer store; afterwards a good
    call still gives the right answer (so no rank launched anything for a rejected call)."""
    W, me = dist.get_world_size(), dist.get_rank()
    T, H = 3, 2
    cs = plain_cos_sin_cache(64, 64)
    nopes, pes, pos = make_inputs(7, W, T, H, 512, 64, 64)
    n, p = nopes[me], pes[me]
    ctor = dict(max_tokens=4, heads_per_rank=H)
    out = {}
    bad_ctor = {
        "max_tokens=0": dict(ctor, max_tokens=0),
        "max_tokens float": dict(ctor, max_tokens=4.0),
        "heads_per_rank=-1": dict(ctor, heads_per_rank=-1),
        "nope_dim=500": dict(ctor, nope_dim=500),
        "rope_dim=48": dict(ctor, rope_dim=48),
        "rope_style": dict(ctor, rope_style="gptj"),
        "out_dtype fp16": dict(ctor, out_dtype=torch.float16),
        "quant_scale=0": dict(ctor, quant_scale=0.0),
        "quant_scale bf16": dict(ctor, out_dtype=BF16, quant_scale=2.0),
        "backend": dict(ctor, backend="nccl"),
        "memory": dict(ctor, memory="nvshmem"),
        "timeout_s": dict(ctor, timeout_s=-1),
        "timeout_s inf": dict(ctor, timeout_s=float("inf")),  # (overflowed after the allocation, leaking it)
        "timeout_s past the bound": dict(ctor, timeout_s=1e12),
        "quant_scale inf in fp32": dict(ctor, quant_scale=1e39),
        "quant_scale 0 in fp32": dict(ctor, quant_scale=1e-46),
        "pad_heads_to=64.0": dict(ctor, pad_heads_to=64.0),
        "pad_heads_to=32": dict(ctor, pad_heads_to=32),
        "impl": dict(ctor, impl="cutlass"),
        "impl torch direct": dict(ctor, backend="direct", impl="torch"),
        "impl cuda on cpu": dict(ctor, impl="cuda", device="cpu"),
        "exchange": dict(ctor, exchange="fp8"),
        "num_programs": dict(ctor, num_programs=0),
    }
    for name, kw in bad_ctor.items():
        out[f"ctor {name}"] = _err(lambda kw=kw: QueryGather(**kw))
    # geometry that differs across ranks: every rank raises, naming the field
    out["ctor mismatched heads"] = _err(lambda: QueryGather(max_tokens=4, heads_per_rank=2 + me))
    # a bad argument on one rank only: that rank gets the ValueError, the others a PeerSetupError
    try:
        QueryGather(max_tokens=4, heads_per_rank=H, rope_dim=48 if me == W - 1 else 64)
        out["ctor one bad rank"] = "no error"
    except (ValueError, PeerSetupError) as e:
        out["ctor one bad rank"] = f"{type(e).__name__}: {e}"

    with QueryGather(backend="direct", exchange="raw", **ctor) as qg:
        calls = {
            "q_nope dtype": lambda: qg.gather(n.float(), p, pos, cs),
            "q_nope shape": lambda: qg.gather(n[:, :1], p, pos, cs),
            "q_nope not tensor": lambda: qg.gather(n.tolist(), p, pos, cs),
            "q_pe width": lambda: qg.gather(n, p[..., :32], pos, cs),
            "q_pe tokens": lambda: qg.gather(n, p[:2], pos, cs),
            "T > max_tokens": lambda: qg.gather(torch.cat([n, n]), torch.cat([p, p]), torch.cat([pos, pos]), cs),
            "q_nope stride": lambda: qg.gather(torch.empty(T, H, 1024, dtype=BF16)[..., 1:513], p, pos, cs),
            "q_nope last dim": lambda: qg.gather(torch.empty(T, 512, H, dtype=BF16).transpose(1, 2), p, pos, cs),
            "positions dtype": lambda: qg.gather(n, p, pos.float(), cs),
            "positions shape": lambda: qg.gather(n, p, pos[:2], cs),
            "positions range": lambda: qg.gather(n, p, pos + 64, cs),
            "positions negative": lambda: qg.gather(n, p, pos - 100, cs),
            "cos_sin dtype": lambda: qg.gather(n, p, pos, cs.double()),
            "cos_sin width": lambda: qg.gather(n, p, pos, cs[:, :32].contiguous()),
            "cos_sin layout": lambda: qg.gather(n, p, pos, cs.t().contiguous().t()),
            "out dtype": lambda: qg.gather(n, p, pos, cs, out=torch.empty(T, W * H, 576, dtype=BF16)),
            "out shape": lambda: qg.gather(n, p, pos, cs, out=torch.empty(T, W * H + 1, 576, dtype=FP8)),
            "exposed T": lambda: qg.exposed_shard(0),
            "exposed T type": lambda: qg.exposed_shard(2.0),
            "gather_exposed first": lambda: qg.gather_exposed(pos, cs),
        }
        for name, fn in calls.items():
            out[f"call {name}"] = _err(fn)
        zn, zp = qg.exposed_shard(T)
        zn.copy_(n)
        zp.copy_(p)
        out["call gather_exposed T"] = _err(lambda: qg.gather_exposed(pos[:2], cs))
        q1 = qg.gather_exposed(pos, cs)
        q2 = qg.gather(n, p, pos, cs)
        ref = widened_query(nopes, pes, pos, cs)
        good = torch.equal(q1.view(torch.uint8), ref.view(torch.uint8)) and torch.equal(
            q2.view(torch.uint8), ref.view(torch.uint8)
        )
    with QueryGather(backend="allgather", **ctor) as ag:
        out["allgather exposed_shard"] = _err(lambda: ag.exposed_shard(T))
        out["allgather bad call"] = _err(lambda: ag.gather(n, p, pos.float(), cs))
        good = good and torch.equal(ag.gather(n, p, pos, cs).view(torch.uint8), ref.view(torch.uint8))
    qg.close()  # idempotent
    out["closed call"] = _err(lambda: qg.gather(n, p, pos, cs))
    return {"errors": out, "good_after": good}


# ----------------------------------------------------------------------------------- missing peer
def missing_peer(
    absent: int, timeout_s: float, memory: str = "auto", impl: str = "auto", tuning: dict | None = None
) -> dict:
    """Rank ``absent`` never calls; the others get PeerTimeoutError within about ``timeout_s`` (CPU: from
    the call itself; GPU: from check() or the next call after the kernel finished), and the object refuses
    every later call with the same error. ``tuning`` changes QueryPolicy fields (e.g. to force the
    CUDA kernel's LL128 protocol); ``copy_mode`` in the result is the kernel mode of the T = 2 call."""
    W, me, dev = dist.get_world_size(), dist.get_rank(), _dev()
    cs = plain_cos_sin_cache(64, 64, device=dev)
    nopes, pes, pos = make_inputs(3, W, 2, 2, 512, 64, 64, device=dev)
    qg = QueryGather(
        max_tokens=4,
        heads_per_rank=2,
        backend="direct",
        memory=memory,
        impl=impl,
        timeout_s=timeout_s,
        device=dev,
        policy=policy(tuning),
    )
    res: dict = {"impl": qg.impl, "memory": qg.memory, "copy_mode": qg._copy_mode(2)}
    try:
        if me == absent:
            time.sleep(timeout_s * 2.0 + 1.0)
            res["role"] = "absent"
            return res
        t0 = time.time()
        try:
            qg.gather(nopes[me], pes[me], pos, cs)
            if dev.type == "cuda":
                torch.cuda.synchronize()  # the kernel returns after timeout_s, having skipped the data
            qg.check()
            res["first"] = "no error"
        except PeerTimeoutError as e:
            res["first"] = f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
        res["dt"] = time.time() - t0
        for name, fn in (
            ("check", qg.check),
            ("again", lambda: qg.gather(nopes[me], pes[me], pos, cs)),
            ("exposed", lambda: qg.exposed_shard(2)),
        ):
            try:
                fn()
                res[name] = "no error"
            except PeerTimeoutError as e:
                res[name] = f"rank={e.rank} peer={e.peer} mech={e.mechanism}"
        return res
    finally:
        qg.close()


# ------------------------------------------------------------------------------------- lifecycle
def _resources() -> dict:
    pid = os.getpid()
    with open(f"/proc/{pid}/maps") as f:
        maps = sum(1 for line in f if "/dev/shm/peerdcp-" in line)
    return {"fds": len(os.listdir(f"/proc/{pid}/fd")), "maps": maps, "shm": len(glob.glob("/dev/shm/peerdcp-*"))}


def lifecycle(cycles: int) -> dict:
    before = _resources()
    reprs = []
    for i in range(cycles):
        qg = QueryGather(max_tokens=4, heads_per_rank=2, backend="direct" if i % 2 == 0 else "allgather")
        reprs.append((qg.backend, qg.memory, qg.impl, bool(qg.reason)))
        qg.close()
        qg.close()
    with QueryGather(max_tokens=4, heads_per_rank=2) as qg:
        auto = (qg.backend, qg.memory, qg.impl, qg.exchange, qg.reason)
    after = _resources()
    return {"before": before, "after": after, "kinds": sorted(set(reprs)), "auto": auto, "closed": qg.closed}


# --------------------------------------------------------------------------------------- GPU only
def gpu_graph(
    memory: str, impl: str, mode: str, replays: int, T: int = 8, H: int = 16, n_sets: int = 8, out_dtype=FP8
) -> dict:
    """One gather captured in a CUDA graph and replayed ``replays`` times with changing inputs and positions
    (``n_sets`` sets rotated through static buffers), the output poisoned before every replay and checked
    on the device after it; the ranks replay independently (no barrier, no host sync in the loop).
    ``mode`` raw | roped | push | push_sn | push_ll12 | push_ll128 | push_plain (the CUDA kernel's LL, SN,
    LL12, LL128 and fenced push at this T: :data:`CUDA_PUSH`) | exposed; ``copy_mode`` in the result is the
    kernel mode the calls used."""
    W, me, dev = dist.get_world_size(), dist.get_rank(), _dev()
    cs = cos_sin_cache("deepseek-v3.2", device=dev)
    ex = "push" if mode.startswith("push") else mode if mode == "roped" else "raw"
    qg = QueryGather(
        max_tokens=T,
        heads_per_rank=H,
        backend="direct",
        memory=memory,
        impl=impl,
        exchange=ex,
        out_dtype=out_dtype,
        pad_heads_to=64 if W * H <= 64 else None,
        device=dev,
        policy=policy(CUDA_PUSH.get(mode)),
    )
    sets, expected, cs_cpu = [], [], cs.cpu()
    for k in range(n_sets):
        nopes, pes, pos = make_inputs(700 + k, W, T, H, 512, 64, cs.shape[0])
        sets.append((nopes[me].to(dev), pes[me].to(dev), pos.to(dev)))
        ref = widened_query(nopes, pes, pos, cs_cpu, out_dtype=out_dtype, pad_heads_to=qg.out_heads)
        expected.append(ref.view(torch.uint8).to(dev))
    s_nope, s_pe, s_pos = (x.clone() for x in sets[0])
    out = torch.empty((T, qg.out_heads, qg.head_dim), dtype=out_dtype, device=dev)

    def step() -> None:
        if mode == "exposed":
            zn, zp = qg.exposed_shard(T)
            zn.copy_(s_nope)  # stands in for the projection writing its output into the exposed views
            zp.copy_(s_pe)
            qg.gather_exposed(s_pos, cs, out=out)
        else:
            qg.gather(s_nope, s_pe, s_pos, cs, out=out)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    eager_ok = bool(torch.equal(out.view(torch.uint8), expected[0]))
    g = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    dist.barrier()
    with torch.cuda.graph(g):
        step()
    torch.cuda.synchronize()
    bad = torch.zeros((), dtype=torch.int64, device=dev)
    t0 = time.time()
    for i in range(replays):
        nope, pe, pos = sets[i % n_sets]
        s_nope.copy_(nope)
        s_pe.copy_(pe)
        s_pos.copy_(pos)
        out.view(torch.uint8).fill_(0xFF)
        g.replay()
        bad += (out.view(torch.uint8) != expected[i % n_sets]).any()
    torch.cuda.synchronize()
    dt = time.time() - t0
    qg.check()
    res = {
        "bad": int(bad),
        "eager_ok": eager_ok,
        "replays": replays,
        "impl": qg.impl,
        "memory": qg.memory,
        "seconds": dt,
        "copy_mode": qg._copy_mode(T),
        "wide": _wide(qg, T),
        "blocks": qg._launch_blocks(qg._copy_mode(T), T) if qg.impl == "cuda" else None,
        "nprog": qg.num_programs,
    }
    del g
    qg.close()
    return res


def sn_bf16_nan_halves(T: int = 5, H: int = 8) -> dict:
    """The BF16 sentinel push with input halves equal to its rest pattern (0xFFFF, a NaN the nope part passes
    through bit for bit): the peers' copies of those halves arrive as the canonical NaN 0x7FC0, our own rows
    keep 0xFFFF, every other byte equals the fp32 reference, and the call completes (no consumer waits for a
    word that looks like rest)."""
    W, me, dev = dist.get_world_size(), dist.get_rank(), _dev()
    cs = cos_sin_cache("deepseek-v3.2", device=dev)
    nopes, pes, pos = make_inputs(4242, W, T, H, 512, 64, cs.shape[0])
    for x in nopes:
        x.view(torch.int16).view(-1)[::97] = -1  # 0xFFFF halves spread over every row
    qg = QueryGather(max_tokens=T, heads_per_rank=H, backend="direct", impl="cuda", exchange="push",
                     out_dtype=BF16, device=dev, policy=policy(CUDA_PUSH["push_sn"]))  # fmt: skip
    mode = qg._copy_mode(T)
    out = qg.gather(nopes[me].to(dev), pes[me].to(dev), pos.to(dev), cs)
    torch.cuda.synchronize()
    qg.check()
    qg.close()
    got = out.cpu().view(torch.int16).view(T, W, H, -1)
    want = widened_query(nopes, pes, pos, cs.cpu(), out_dtype=BF16).view(torch.int16).view(T, W, H, -1).clone()
    rest = want == -1
    for s in range(W):
        if s != me:
            want[:, s][rest[:, s]] = 0x7FC0
    return {
        "mode": mode,
        "rest_halves": int(rest.sum()),
        "equal": bool(torch.equal(got, want)),
        "mismatches": int((got != want).sum()),
    }


def gpu_bad_inputs() -> dict:
    """GPU-specific input errors: tensors on the wrong device, before any launch; then a good call."""
    W, me, dev = dist.get_world_size(), dist.get_rank(), _dev()
    cs = plain_cos_sin_cache(64, 64, device=dev)
    nopes, pes, pos = make_inputs(9, W, 3, 2, 512, 64, 64, device=dev)
    n, p = nopes[me], pes[me]
    out = {}
    with QueryGather(max_tokens=4, heads_per_rank=2, backend="direct") as qg:
        out["q_nope on cpu"] = _err(lambda: qg.gather(n.cpu(), p, pos, cs))
        out["positions on cpu"] = _err(lambda: qg.gather(n, p, pos.cpu(), cs))
        out["cos_sin on cpu"] = _err(lambda: qg.gather(n, p, pos, cs.cpu()))
        out["host memory on gpu"] = _err(lambda: QueryGather(max_tokens=4, heads_per_rank=2, memory="host"))
        q = qg.gather(n, p, pos, cs)
        torch.cuda.synchronize()
        ref = widened_query([x.cpu() for x in nopes], [x.cpu() for x in pes], pos.cpu(), cs.cpu())
        good = bool(torch.equal(q.cpu().view(torch.uint8), ref.view(torch.uint8)))
        meta = (qg.backend, qg.memory, qg.impl, qg.reason)
    return {"errors": out, "good_after": good, "meta": meta}


def subnormal_pe() -> dict:
    """BF16 output with q_pe of bf16 subnormals (|x| < 2^-126): every CPU kernel path against the fp32 reference,
    bit for bit (Triton 3.6's interpreter widens bf16 subnormals wrongly; the kernels widen the bits themselves)."""
    W, me = dist.get_world_size(), dist.get_rank()
    T, H = 2, 2
    cs = plain_cos_sin_cache(64, 64)
    g = torch.Generator().manual_seed(5)
    nopes = [torch.randn(T, H, 512, generator=g).to(BF16) for _ in range(W)]
    pes = [(torch.randn(T, H, 64, generator=g) * 5e-39).to(BF16) for _ in range(W)]
    pos = torch.tensor([0, 17])
    ref = widened_query(nopes, pes, pos, cs, out_dtype=BF16)
    ref64 = widened_query(nopes, pes, pos, cs, out_dtype=BF16, compute_dtype=torch.float64)
    res = {"ref32 == ref64": torch.equal(ref.view(torch.int16), ref64.view(torch.int16))}
    for backend, ex in (("direct", "raw"), ("direct", "push"), ("allgather", None)):
        kw = dict(exchange=ex) if ex else {}
        with QueryGather(max_tokens=T, heads_per_rank=H, out_dtype=BF16, backend=backend, timeout_s=30.0, **kw) as qg:
            q = qg.gather(nopes[me], pes[me], pos, cs)
        res[f"{backend} {ex}"] = int((q.view(torch.int16) != ref.view(torch.int16)).sum())
    return res


def mismatch_map(case: dict, impl: str, exchange: str, memory: str = "vmm") -> dict:
    """Diagnosis (scripts/diag/query_mismatch.py, in git history): one path of a matrix case against the fp32
    reference, and where
    its bytes differ - per token, widened head and part (nope / rope) - with the first few (got, expected) codes;
    ``poison`` counts elements still at the poison pattern (never written)."""
    T, nopes, pes, pos, cs, r32, _, common = case_setup(case, 2000 + case.get("T", 5))
    me = dist.get_rank()
    with QueryGather(backend="direct", memory=memory, exchange=exchange, impl=impl, **common) as qg:
        out = qg.gather(nopes[me], pes[me], pos, cs, out=poisoned(qg, T)).cpu()
        nope = qg.nope_dim
        bits = torch.uint8 if case["out"] == FP8 else torch.int16
        slot_bad = -1  # roped: this rank's finished rows in its own parity slot (first call: slot 1), as the producer
        if exchange == "roped":  # stored them, against its own rows of the reference
            H, D = qg.heads_per_rank, qg.head_dim
            rows = qg._buf.view(me, (T, H, D), out.dtype, qg._layout.data_off + qg._layout.slot_bytes).cpu()
            mine = r32[:, me * H : (me + 1) * H]
            slot_bad = int((rows.view(bits) != mine.view(bits)).sum())
    got, exp = out.view(bits), r32.view(bits)
    bad = (got != exp).nonzero().tolist()
    where: dict = {}
    for t, hw, c in bad:
        key = f"t{t} h{hw} {'nope' if c < nope else 'rope'}"
        where[key] = where.get(key, 0) + 1
    poison = int((got == (-1 if bits == torch.int16 else 0xFF)).sum())
    sample = [(t, hw, c, int(got[t, hw, c]), int(exp[t, hw, c])) for t, hw, c in bad[:6]]
    return {"bad": len(bad), "of": got.numel(), "poison": poison, "slot_bad": slot_bad,
            "where": dict(list(where.items())[:24]), "sample": sample, "pos": pos.cpu().tolist()}  # fmt: skip
