"""Capability probe: for each memory kind, whether it is eligible and every reason why (or why not).

No hardware whitelist: each reason is a check that ran here. With a process group the checks are made
on every rank and combined (a kind is eligible only if it is eligible on every rank); without one, the
probe looks at this process and every pair of GPUs it can see.
"""

from __future__ import annotations

import functools
import json
import os
import platform
from dataclasses import asdict, dataclass, field

import torch

from .._runtime.groups import GroupInfo

__all__ = [
    "Check",
    "KindReport",
    "Capabilities",
    "probe",
    "KINDS",
    "SHARED_GPU_ENV",
    "shared_gpu_allowed",
    "ranks_share_gpus",
]

KINDS = ("vmm", "symm", "host")

#: Set to 1 (on every rank) to let ranks share a GPU (rank r on GPU r % count): the peer-memory paths then run
#: with more ranks than GPUs, for correctness tests only (the ranks' processes time-slice the GPU).
SHARED_GPU_ENV = "PEERDCP_SHARED_GPU"


def shared_gpu_allowed() -> bool:
    """Whether this process opted in to ranks sharing a GPU (``PEERDCP_SHARED_GPU=1``)."""
    return os.environ.get(SHARED_GPU_ENV, "") == "1"


def ranks_share_gpus(world: int) -> bool:
    """Whether ``world`` ranks on this host run with ranks sharing GPUs: opted in, and fewer GPUs than ranks
    (with a GPU per rank the opt-in changes nothing)."""
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return shared_gpu_allowed() and 1 <= ngpu < world


@dataclass
class Check:
    name: str
    ok: bool
    detail: str = ""


@dataclass
class KindReport:
    kind: str
    eligible: bool
    checks: list[Check] = field(default_factory=list)

    @property
    def reasons(self) -> list[str]:
        """Failed checks if ineligible, else every check (so the report says why it is eligible)."""
        failed = [c for c in self.checks if not c.ok]
        src = failed if failed else self.checks
        return [f"{c.name}: {c.detail}" if c.detail else c.name for c in src]


@dataclass
class Capabilities:
    rank: int
    world_size: int
    cuda: bool
    devices: list[str]
    versions: dict[str, str]
    kinds: dict[str, KindReport]

    def eligible(self, kind: str) -> bool:
        return self.kinds[kind].eligible

    def auto(self, *, gpu: bool) -> tuple[str | None, str]:
        """The memory kind ``auto`` picks (vmm, then symm; host for CPU tensors) and why."""
        if not gpu:
            k = self.kinds["host"]
            return ("host" if k.eligible else None), "CPU tensors: host memory; " + "; ".join(k.reasons)
        for kind in ("vmm", "symm"):
            if self.kinds[kind].eligible:
                return kind, f"{kind} eligible ({'; '.join(self.kinds[kind].reasons)})"
        why = " | ".join(f"{k}: {'; '.join(self.kinds[k].reasons)}" for k in ("vmm", "symm"))
        return None, f"no GPU peer memory is eligible ({why})"

    def to_dict(self) -> dict:
        d = asdict(self)
        for k, rep in self.kinds.items():
            d["kinds"][k]["reasons"] = rep.reasons
        return d

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def table(self) -> str:
        lines = [
            f"peerdcp probe: rank {self.rank} of {self.world_size}, CUDA {'yes' if self.cuda else 'no'}",
            "versions: " + ", ".join(f"{k} {v}" for k, v in self.versions.items()),
        ]
        if self.devices:
            lines.append("devices: " + "; ".join(self.devices))
        for kind in KINDS:
            rep = self.kinds[kind]
            lines.append(f"  {kind:5s} {'ELIGIBLE' if rep.eligible else 'not eligible'}")
            for c in rep.checks:
                lines.append(f"        [{'x' if c.ok else ' '}] {c.name}" + (f": {c.detail}" if c.detail else ""))
        return "\n".join(lines)


def _versions() -> dict[str, str]:
    v = {"python": platform.python_version(), "torch": torch.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        v["triton"] = "missing"
    if torch.cuda.is_available():
        v["cuda"] = str(torch.version.cuda)
    try:
        from importlib.metadata import version

        v["cuda-bindings"] = version("cuda-bindings")
    except Exception:  # noqa: BLE001
        v["cuda-bindings"] = "missing"
    return v


def _shm_check() -> Check:
    ok = os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK)
    return Check("POSIX shared memory", ok, "/dev/shm writable" if ok else "/dev/shm missing or read-only")


def _local_gpu_facts(device_index: int | None) -> dict:
    if torch.cuda.is_available() and device_index is None:
        device_index = torch.cuda.current_device()
    return dict(_local_gpu_facts_cached(device_index))


@functools.cache
def _local_gpu_facts_cached(device_index: int | None) -> dict:
    """Facts about this process's GPU(s), JSON-serialisable so ranks can all-gather them."""
    facts: dict = {"cuda": torch.cuda.is_available(), "host": platform.node(), "pid": os.getpid()}
    facts["shared_gpu"] = shared_gpu_allowed()
    if not facts["cuda"]:
        return facts
    n = torch.cuda.device_count()
    facts["uuids"] = [str(torch.cuda.get_device_properties(i).uuid) for i in range(n)]
    facts["names"] = [torch.cuda.get_device_name(i) for i in range(n)]
    facts["device"] = device_index if device_index is not None else torch.cuda.current_device()
    try:
        from ._cuda import check, driver

        cu = driver()
        facts["driver"] = True
        A = cu.CUdevice_attribute
        dev = check(cu.cuDeviceGet(facts["device"]), "cuDeviceGet")

        def attr(name: str) -> int:
            return int(check(cu.cuDeviceGetAttribute(getattr(A, name), dev), name))

        facts["vmm"] = attr("CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED")
        facts["posix_fd"] = attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
        facts["fabric_attr"] = attr("CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED")
        facts["fabric_trial"] = _fabric_trial(cu, facts["device"])
        p2p = {}
        P = cu.CUdevice_P2PAttribute
        for j in range(n):
            if j == facts["device"]:
                continue
            pj = check(cu.cuDeviceGet(j), "cuDeviceGet")
            can = int(check(cu.cuDeviceCanAccessPeer(dev, pj), "cuDeviceCanAccessPeer"))
            back = int(check(cu.cuDeviceCanAccessPeer(pj, dev), "cuDeviceCanAccessPeer"))
            atom = int(
                check(
                    cu.cuDeviceGetP2PAttribute(P.CU_DEVICE_P2P_ATTRIBUTE_NATIVE_ATOMIC_SUPPORTED, dev, pj),
                    "cuDeviceGetP2PAttribute",
                )
            )
            p2p[facts["uuids"][j]] = {"to": can, "from": back, "atomics": atom}
        facts["p2p"] = p2p
    except Exception as e:  # noqa: BLE001
        facts["driver"] = False
        facts["driver_error"] = f"{type(e).__name__}: {e}"
    facts["nvlink"] = _nvlink_links(facts.get("device", 0))
    try:
        import torch.distributed._symmetric_memory as _sm  # noqa: F401

        facts["symm"] = True
    except Exception as e:  # noqa: BLE001
        facts["symm"] = False
        facts["symm_error"] = str(e)
    return facts


def _fabric_trial(cu, device_index: int) -> str:
    """Try one FABRIC-handle allocation; 'ok' or the driver's answer (e.g. CUDA_ERROR_NOT_PERMITTED)."""
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_FABRIC
    err, gran = cu.cuMemGetAllocationGranularity(
        prop, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
    )
    if int(err) != 0:
        return f"granularity query failed ({err})"
    err, h = cu.cuMemCreate(int(gran), prop, 0)
    if int(err) != 0:
        _, name = cu.cuGetErrorName(err)
        return name.decode() if isinstance(name, bytes) else str(name)
    cu.cuMemRelease(h)
    return "ok"


def _nvlink_links(device_index: int) -> int | None:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device_index)
        n = 0
        for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
            try:
                if pynvml.nvmlDeviceGetNvLinkState(h, link) == pynvml.NVML_FEATURE_ENABLED:
                    n += 1
            except pynvml.NVMLError:
                break
        return n
    except Exception:  # noqa: BLE001 - pynvml missing or NVML unavailable
        return None


def _evaluate(all_facts: list[dict], rank: int) -> dict[str, KindReport]:
    me = all_facts[rank]
    W = len(all_facts)
    reports: dict[str, KindReport] = {}

    hosts = {f["host"] for f in all_facts}
    one_host = Check("one host", len(hosts) == 1, f"{W} process(es) on {sorted(hosts)}")
    reports["host"] = KindReport("host", False, [one_host, _shm_check()])

    gpu_checks: list[Check] = [one_host]
    cuda_all = all(f["cuda"] for f in all_facts)
    gpu_checks.append(Check("CUDA present", cuda_all, "on every rank" if cuda_all else "a rank has no CUDA device"))
    if cuda_all:
        drv = all(f.get("driver") for f in all_facts)
        gpu_checks.append(
            Check("CUDA driver API (cuda-python)", drv, "loaded" if drv else me.get("driver_error", "failed on a peer"))
        )
    else:
        drv = False
    p2p_ok = atom_ok = False
    shared = False  # some ranks on one GPU
    if cuda_all and drv:
        mine = [f["uuids"][f["device"]] for f in all_facts]
        ndev = len(set(mine))  # GPUs the ranks are on
        shared = ndev < W
        distinct, detail = not shared, ", ".join(u[-12:] for u in mine)
        if shared and all(f.get("shared_gpu") for f in all_facts):
            # Correctness testing with more ranks than GPUs: ranks on one GPU map each other's memory like peers;
            # their processes time-slice the GPU, so every wait lasts scheduling slices (milliseconds): no timing.
            distinct, detail = True, f"{detail} (ranks share GPUs: {SHARED_GPU_ENV}=1, correctness testing only)"
        gpu_checks.append(Check("distinct devices", distinct, detail))
        if W == 1:
            p2p_ok = atom_ok = True
            gpu_checks.append(Check("peer access", True, "single rank: no peers"))
        else:
            peers = [u for u in mine if u != mine[rank]]
            missing = [u for u in peers if u not in me["p2p"]]
            problems = []
            if missing:
                problems.append(f"peer device(s) not visible here: {[u[-12:] for u in missing]}")
            for u in peers:
                e = me["p2p"].get(u)
                if e and not (e["to"] and e["from"]):
                    problems.append(f"no P2P both ways with {u[-12:]}")
            p2p_ok = not problems
            gpu_checks.append(Check("cuDeviceCanAccessPeer both ways", p2p_ok, "; ".join(problems) or "all pairs"))
            atom_ok = p2p_ok and all(me["p2p"][u]["atomics"] for u in peers if u in me["p2p"])
            gpu_checks.append(Check("native peer atomics", atom_ok, "all pairs" if atom_ok else "missing on a pair"))
        links = me.get("nvlink")
        if ndev == 1 and W > 1:  # only possible with PEERDCP_SHARED_GPU (checked above)
            gpu_checks.append(Check("NVLink", True, "every rank on one GPU: no link used"))
        else:
            gpu_checks.append(
                Check(
                    "NVLink",
                    bool(links) or links is None,
                    f"{links} active links" if links is not None else "unknown (pynvml/NVML unavailable); not required",
                )
            )
    base_ok = all(c.ok for c in gpu_checks)

    vmm_checks = list(gpu_checks)
    if cuda_all and drv:
        v = all(f.get("vmm") for f in all_facts)
        fd = all(f.get("posix_fd") for f in all_facts)
        vmm_checks.append(Check("VMM supported", v, "CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED"))
        vmm_checks.append(
            Check("POSIX fd export", fd, "CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED")
        )
        fab = [f.get("fabric_trial") for f in all_facts]
        vmm_checks.append(
            Check(
                "fabric handles (optional, not used)",
                True,
                "trial allocation ok on every rank"
                if all(x == "ok" for x in fab)
                else f"trial cuMemCreate(FABRIC): {sorted(set(map(str, fab)))}; POSIX fds are used",
            )
        )
    reports["vmm"] = KindReport("vmm", all(c.ok for c in vmm_checks), vmm_checks)

    symm_checks = list(gpu_checks)
    s = all(f.get("symm") for f in all_facts)
    symm_checks.append(
        Check("torch symmetric memory", s, f"torch {torch.__version__}" if s else me.get("symm_error", "missing"))
    )
    if shared:
        # measured (torch 2.11): CUDASymmetricMemoryAllocator::rendezvous "detected allocations from overlapping
        # devices"
        symm_checks.append(Check("one rank per GPU", False, f"ranks share GPUs ({SHARED_GPU_ENV}): torch refuses"))
    reports["symm"] = KindReport("symm", all(c.ok for c in symm_checks) and base_ok, symm_checks)

    reports["host"].eligible = all(c.ok for c in reports["host"].checks)
    return reports


def probe(group=None, *, device: int | None = None) -> Capabilities:
    """Probe what peer memory this process (and its group, if torch.distributed is initialised) can use.

    Collective when a group is given or the default group exists; otherwise a local probe that treats
    every visible GPU pair as the candidate group.
    """
    import torch.distributed as dist

    info: GroupInfo | None = None
    if group is not None or (dist.is_available() and dist.is_initialized()):
        from .._runtime.groups import resolve_group

        info = resolve_group(group)
    facts = _local_gpu_facts(device)
    if info is not None:
        from .._runtime.groups import all_gather_object

        all_facts = all_gather_object(info, facts)
        rank, W = info.rank, info.world_size
    elif facts["cuda"] and len(facts["uuids"]) > 1:
        # Local probe: pretend one rank per visible GPU (each sees the same facts, device = its index).
        all_facts = []
        for i in range(len(facts["uuids"])):
            f = dict(facts) if i == facts["device"] else {**_local_gpu_facts(i)}
            all_facts.append(f)
        rank, W = facts["device"], len(all_facts)
    else:
        all_facts, rank, W = [facts], 0, 1
    kinds = _evaluate(all_facts, rank)
    devices = [f"{i}: {n}" for i, n in enumerate(facts.get("names", []))]
    return Capabilities(rank, W, bool(facts["cuda"]), devices, _versions(), kinds)
