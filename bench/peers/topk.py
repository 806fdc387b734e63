"""vLLM 0.34.0's DCP Top-K merge peers (issue 54): the candidate pack and the symmetric-memory push.

``vllm/model_executor/kernels/attention/dsa/dcp_indexer_cutedsl.py`` holds the all-gather merge: each rank packs
its local top-k as ``(score, global id)`` fp32 pairs (``pack_dcp_topk_candidates_cutedsl``, a Triton kernel,
the id stored as a float), a dim-0 NCCL all-gather, then ``stable_topk_from_gathered_candidates_cutedsl``
(a CuTeDSL radix select: key = the score's high ``score_bits`` then the complemented id, so equal scores
keep the smaller id; its output is in atomic-commit order, unsorted). ``dcp_topk_direct.py`` replaces the
all-gather by a Triton push of the packed pairs into every peer's symmetric-memory inbox
(``_push_candidates_kernel``), a Triton publish/wait kernel, and a CuTeDSL select over the ping-pong inbox.

What runs here without vLLM's runtime: the pack and the push (plain Triton; under ``TRITON_INTERPRET=1`` on
CPU the inbox pointers are plain tensors' addresses, one inbox per simulated rank). What does not: both
selects (CuTeDSL: nvidia-cutlass-dsl 4.8 + quack-kernels + cuda-bindings, compiled through the CUDA driver,
so never on CPU; the libs-cu12 / -cu13 wheel alone is 92 MB, more than the 64 MiB ``carry`` takes to the
GPU machine) and the publish kernel (PTX ``trap`` in ``inline_asm_elementwise``, which the interpreter does
not run). Without a select there are no vLLM ids to compare or time, so :func:`check` verifies what the
pack and push produce: every candidate pair, and that peerdcp's ``canonical_topk`` over the gathered (or
pushed) candidates equals ``canonical_topk`` over the full logits, i.e. vLLM's ownership interleave and id
mapping agree with peerdcp's sharding.

Tie and order rules against ``canonical_topk`` (score desc, id asc, NaN lowest, -0 == +0): vLLM's key also
keeps the smaller id among equal scores, but orders -0 below +0 (raw sign-magnitude bits), ranks a positive
NaN above +inf, keeps -inf candidates with their ids (only id -1 is padding), and with ``score_bits = 16``
(BF16 logits) ties every pair of scores equal in their top 16 bits. For finite logits without signed zeros
at ``score_bits = 32`` the two selections are the same set; vLLM's is unsorted.
"""

from __future__ import annotations

import types

import torch

from bench import peers

REL_AG = "vllm/model_executor/kernels/attention/dsa/dcp_indexer_cutedsl.py"
REL_DIRECT = "vllm/model_executor/kernels/attention/dsa/dcp_topk_direct.py"
CUTEDSL_WHY = (
    "CuTeDSL (nvidia-cutlass-dsl 4.8, quack-kernels 0.6.5, cuda-bindings; vLLM pins the cu13 libs): "
    "compiled through the CUDA driver, never on CPU, and the libs wheel alone (92 MB) exceeds the "
    "64 MiB carry to the offline GPU machine"
)


class _Named:
    """Stand-in for a CuTeDSL type or namespace: any attribute is another stand-in; the few values the
    module reads at class creation (``Uint64.width``, ``cute.arch.WARP_SIZE``) are given."""

    def __init__(self, **known) -> None:
        self.__dict__.update(known)

    def __getattr__(self, name: str):
        return _Named()

    def __getitem__(self, item):
        return _Named()

    def __call__(self, *args, **kwargs):
        raise RuntimeError("a CuTeDSL stand-in was called: this path needs nvidia-cutlass-dsl")


def _cutedsl_stubs() -> dict[str, dict]:
    """The third-party names ``dcp_indexer_cutedsl.py`` binds at import; none is used by the Triton pack."""
    return {
        "cutlass": dict(
            Float32=_Named(width=32),
            Int32=_Named(width=32),
            Uint32=_Named(width=32),
            Uint64=_Named(width=64),
            range_constexpr=range,
            const_expr=bool,
            utils=_Named(),
        ),
        "cutlass.cute": dict(
            arch=_Named(WARP_SIZE=32), struct=_Named(), jit=_Named(), kernel=_Named(), Tensor=_Named(), runtime=_Named()
        ),
        "cuda": {},
        "cuda.bindings": {},
        "cuda.bindings.driver": dict(CUstream=_Named()),
        "quack": {},
        "quack.compile_utils": dict(make_fake_tensor=peers._never),
        "vllm.cute_utils": dict(recast_val=peers._never),
        "vllm.model_executor.warmup.jit_warmup_cutedsl_helper": dict(
            CuTeDSLLaunchSpec=peers._Placeholder, VllmCuTeDSLJitKernel=peers._Placeholder
        ),
    }


class _TritonLaunch:
    """Stands in for vLLM's JIT-warmup launcher: calls the kernel object's ``__call__`` for vLLM's own grid and
    constexprs (the stand-in ``kernel_launcher`` leaves it returning them) and launches its Triton kernel."""

    def __init__(self, obj, tensor_names: tuple[str, ...], tensor_kw: dict[str, str]) -> None:
        self.obj, self.tensor_names, self.tensor_kw = obj, tensor_names, tensor_kw

    def __call__(self, *tensors, **kw):
        grid, launch = self.obj(*tensors, **kw)
        args = dict(zip(self.tensor_names, tensors))
        for dst, src in self.tensor_kw.items():  # a tensor the launch spec renames (row_starts_arg -> row_starts)
            args[dst] = launch.pop(dst, args.pop(src, None))
        keyed = set(type(self.obj).CompileKey.__dataclass_fields__)
        scalars = {k: v for k, v in kw.items() if k not in keyed}
        type(self.obj).kernel[grid](**args, **scalars, **launch)


def load_ag() -> tuple[types.ModuleType | None, str]:
    """``dcp_indexer_cutedsl`` with its Triton pack runnable (the CuTeDSL select is not), or ``(None, why)``."""
    key = "topk_ag_wrapped"
    if key in peers._cache:
        return peers._cache[key]
    mod, why = peers.load_vllm_file(REL_AG, _cutedsl_stubs())
    if mod is not None:
        try:
            obj = mod._PACK_DCP_TOPK_CANDIDATES_KERNEL
            if not isinstance(obj, _TritonLaunch):
                mod._PACK_DCP_TOPK_CANDIDATES_KERNEL = _TritonLaunch(
                    obj, ("logits", "topk_indices", "packed", "row_starts_arg"), {"row_starts": "row_starts_arg"}
                )
        except AttributeError as e:
            mod, why = None, f"{why}: the pack kernel is not where 0.34.0 has it ({e})"
    peers._cache[key] = (mod, why)
    return mod, why


def load_direct() -> tuple[types.ModuleType | None, str]:
    """``dcp_topk_direct`` (its Triton push kernel), or ``(None, why)``."""
    return peers.load_vllm_file(REL_DIRECT)


def pack(
    mod: types.ModuleType, logits: torch.Tensor, local_idx: torch.Tensor, rank: int, world: int, interleave: int
) -> torch.Tensor:
    """vLLM's pack of one rank: ``[rows, k, 2]`` fp32 ``(score, global id)``, ``(-inf, -1)`` where ``local_idx``
    is -1."""
    out = torch.empty((local_idx.shape[0], local_idx.shape[1], 2), dtype=torch.float32, device=logits.device)
    mod.pack_dcp_topk_candidates_cutedsl(logits, local_idx, out, rank, world, interleave, None)
    return out


def push(mod: types.ModuleType, packed: list[torch.Tensor], max_rows: int, slot: int = 0) -> list[torch.Tensor]:
    """vLLM's ``_push_candidates_kernel`` from every simulated rank into W plain inboxes (the ping-pong shape of
    ``DirectDCPTopKWorkspace``, ``[2, max_rows, W * k, 2]``); returns each rank's inbox."""
    W = len(packed)
    rows, k, _ = packed[0].shape
    dev = packed[0].device
    inboxes = [torch.full((2, max_rows, W * k, 2), float("nan"), device=dev) for _ in range(W)]
    ptrs = torch.tensor([t.data_ptr() for t in inboxes], dtype=torch.int64, device=dev)
    seq = torch.full((1,), slot, dtype=torch.int64, device=dev)
    n = rows * k * 2
    for r in range(W):
        mod._push_candidates_kernel[(-(-n // 1024),)](
            ptrs,
            seq,
            packed[r].contiguous(),
            n,
            my_rank=r,
            world_size=W,
            local_elems=k * 2,
            slot_elems=max_rows * W * k * 2,
            block_size=1024,
            launch_pdl=False,
        )
    return inboxes


def _local_topk(logits: torch.Tensor, lens: torch.Tensor, k: int, rank: int, W: int, I: int):
    """A rank's shard of ``logits`` (peerdcp's ownership: global id g on rank (g // I) % W) and its local top-k
    indices (canonical order, -1 padded): the input vLLM's pack takes."""
    from peerdcp.topk.candidates import canonical_topk

    L = logits.shape[1]
    g = torch.arange(L, device=logits.device)
    mine = g[(g // I) % W == rank]
    local = logits[:, mine].contiguous()
    local_lens = ((mine[None, :] < lens[:, None]).sum(1)).to(torch.int32)
    return local, canonical_topk(local, local_lens, k), mine


def check(
    device: str, world: int = 2, rows: int = 3, L: int = 1200, k: int = 256, interleave: int = 1, seed: int = 54
) -> list[tuple[str, bool | None, str]]:
    """vLLM's pack (and push) for ``world`` simulated ranks: ``[(peer, ok, detail)]``, ``ok`` None when not loaded.

    Each pair must be ``(logits[row, local id], vLLM's global id)`` and ``canonical_topk`` over all ranks'
    candidates must equal ``canonical_topk`` over the full logits (rows of different lengths, one shorter than k).
    """
    from peerdcp.topk.candidates import canonical_topk

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, L, generator=g).to(device)
    lens = torch.tensor([L, L // 2, k // 2 + 1][:rows] + [L] * max(0, rows - 3), dtype=torch.int32, device=device)
    want = canonical_topk(logits, lens, k)
    shards = [_local_topk(logits, lens, k, r, world, interleave) for r in range(world)]
    out = []
    mod, why = load_ag()
    if mod is None:
        return [("vllm-topk-pack", None, why), ("vllm-topk-push", None, why)]
    packed, bad = [], 0
    for r, (local, idx, mine) in enumerate(shards):
        p = pack(mod, local, idx, r, world, interleave)
        valid = idx >= 0
        exp_id = torch.where(valid, mine[idx.clamp_min(0).long()], -1).float()
        exp_sc = torch.where(valid, local.gather(1, idx.clamp_min(0).long()), float("-inf"))
        bad += int((p[..., 1] != exp_id).sum()) + int((p[..., 0] != exp_sc).sum())
        packed.append(p)
    gathered = torch.stack(packed)  # the dim-0 all-gather: [W, rows, k, 2]

    def merged(cands: torch.Tensor) -> torch.Tensor:
        # the candidates as logits by global id (-inf elsewhere), then peerdcp's canonical selection
        full = torch.full_like(logits, float("-inf"))
        ids = cands[..., 1].long()
        ok = ids >= 0
        r_idx = torch.arange(rows, device=device)[:, None].expand_as(ids)
        full[r_idx[ok], ids[ok]] = cands[..., 0][ok]
        return canonical_topk(full, lens, k)

    flat = gathered.permute(1, 0, 2, 3).reshape(rows, world * k, 2)
    same = bool(torch.equal(merged(flat), want))
    out.append(
        (
            "vllm-topk-pack",
            bad == 0 and same,
            f"W={world} rows={rows} L={L} k={k} I={interleave}: {bad} pack fields wrong; canonical_topk of the "
            f"gathered candidates {'equals' if same else 'DIFFERS from'} canonical_topk of the full logits "
            f"(vLLM's stable select not run: {CUTEDSL_WHY})",
        )
    )
    dmod, dwhy = load_direct()
    if dmod is None:
        out.append(("vllm-topk-push", None, dwhy))
        return out
    inboxes = push(dmod, packed, max_rows=rows + 1, slot=1)
    n_bad = sum(int((ib[1, :rows] != flat).sum()) for ib in inboxes)
    untouched = all(bool(ib[0].isnan().all() and ib[1, rows:].isnan().all()) for ib in inboxes)
    out.append(
        (
            "vllm-topk-push",
            n_bad == 0 and untouched,
            f"W={world} rows={rows} k={k}: {n_bad} inbox values differ from the all-gather layout, other slot "
            f"{'untouched' if untouched else 'WRITTEN'} (publish kernel not run: PTX trap via inline asm; "
            f"select not run: {CUTEDSL_WHY})",
        )
    )
    return out
