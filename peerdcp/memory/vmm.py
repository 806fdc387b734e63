"""CUDA VMM peer memory: ``cuMemCreate`` + POSIX-fd export, fds passed over a Unix socket (SCM_RIGHTS),
imported by every rank and mapped into **one contiguous rank-major VA range** (``base + r*stride``).

Protocol (every step agreed over the gloo group; a failure anywhere rolls back everywhere):
1. ``cuMemCreate`` (pinned device memory, POSIX fd handle type) of ``stride`` bytes, zero it;
2. ``cuMemExportToShareableHandle`` -> fd; each rank binds an abstract-namespace SOCK_DGRAM socket, the
   addresses are all-gathered, and every rank sends its fd to every peer with SCM_RIGHTS (no ptrace
   capability needed, nothing in the filesystem);
3. ``cuMemImportFromShareableHandle`` for each peer fd (closed right after), ``cuMemAddressReserve`` of
   ``W*stride``, ``cuMemMap`` each rank's handle at ``base + r*stride``, ``cuMemSetAccess`` read/write for
   the local device, ``cuMemRelease`` every handle (the mappings keep the memory alive).
Teardown (collective): device sync, barrier, ``cuMemUnmap`` each segment, ``cuMemAddressFree``.
Fabric handles are never used here: on these machines ``cuMemCreate`` with FABRIC answers
NOT_PERMITTED; :mod:`peerdcp.memory.probe` reports whether a trial fabric allocation works.
"""

from __future__ import annotations

import array
import os
import socket
import struct
import uuid

import torch

from .._runtime.checks import cuda_index
from .._runtime.groups import GroupInfo, agree, all_gather_object
from ._cuda import check, driver, tensor_from_device_ptr
from .buffer import PeerBuffer

__all__ = ["allocate_vmm", "vmm_granularity"]


def _prop(cu, device_index: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device_index
    prop.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    return prop


def vmm_granularity(device_index: int) -> int:
    cu = driver()
    gran = check(
        cu.cuMemGetAllocationGranularity(
            _prop(cu, device_index), cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        ),
        "cuMemGetAllocationGranularity",
    )
    return int(gran)


def _exchange_fds(info: GroupInfo, fd: int, timeout_s: float = 60.0) -> dict[int, int]:
    """Send ``fd`` to every peer and receive theirs; returns {peer rank: received fd}."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    received: dict[int, int] = {}
    err: BaseException | None = None
    try:
        addr = f"\0peerdcp-{uuid.uuid4().hex}-r{info.rank}"
        sock.bind(addr)
        sock.settimeout(timeout_s)
    except BaseException as e:  # noqa: BLE001
        err = e
    addrs = all_gather_object(info, None if err else addr)
    try:
        agree(info, err, "vmm fd exchange (bind)")
        for r, a in enumerate(addrs):
            if r != info.rank:
                # (socket.send_fds ignores its address argument on CPython <= 3.12: use sendmsg)
                sock.sendmsg(
                    [struct.pack("<i", info.rank)],
                    [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [fd]))],
                    0,
                    a,
                )
        while len(received) < info.world_size - 1:
            msg, fds, _flags, _addr = socket.recv_fds(sock, 16, 1)
            if len(msg) != 4 or len(fds) != 1:
                for f in fds:
                    os.close(f)
                raise RuntimeError("malformed fd message")
            received[struct.unpack("<i", msg)[0]] = fds[0]
    except BaseException:
        for f in received.values():
            os.close(f)
        sock.close()
        raise
    sock.close()
    return received


def allocate_vmm(info: GroupInfo, nbytes: int, device: torch.device) -> PeerBuffer:
    cu = driver()
    dev = cuda_index(device)
    torch.cuda.set_device(dev)
    torch.cuda.init()
    torch.empty(1, device=f"cuda:{dev}")  # make the primary context current for driver calls
    W = info.world_size

    handles: dict[int, object] = {}
    fds_in: dict[int, int] = {}
    va = None
    stride = 0
    mapped: list[int] = []
    own_fd = -1

    def rollback() -> None:
        nonlocal va
        for r in mapped:
            cu.cuMemUnmap(cu.CUdeviceptr(int(va) + r * stride), stride)
        mapped.clear()
        if va is not None:
            cu.cuMemAddressFree(va, W * stride)
            va = None
        for h in handles.values():
            cu.cuMemRelease(h)
        handles.clear()
        for f in fds_in.values():
            os.close(f)
        fds_in.clear()
        if own_fd >= 0:
            try:
                os.close(own_fd)
            except OSError:
                pass

    # 1. create + export
    err: BaseException | None = None
    try:
        gran = vmm_granularity(dev)
        stride = max(gran, -(-nbytes // gran) * gran)
        handles[info.rank] = check(cu.cuMemCreate(stride, _prop(cu, dev), 0), "cuMemCreate")
        own_fd = int(
            check(
                cu.cuMemExportToShareableHandle(
                    handles[info.rank], cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0
                ),
                "cuMemExportToShareableHandle",
            )
        )
    except BaseException as e:  # noqa: BLE001
        err = e
    strides = all_gather_object(info, stride)
    try:
        agree(info, err, "vmm allocation (create)")
        if len(set(strides)) != 1:
            raise ValueError(f"ranks disagree on the VMM stride: {strides}")
    except BaseException:
        rollback()
        raise

    # 2. pass fds
    try:
        fds_in.update(_exchange_fds(info, own_fd))
    except BaseException as e:  # noqa: BLE001
        err = e
    else:
        err = None
    try:
        agree(info, err, "vmm allocation (fd exchange)")
    except BaseException:
        rollback()
        raise
    os.close(own_fd)
    own_fd = -1

    # 3. import, reserve, map, set access, release handles
    err = None
    try:
        for r, f in list(fds_in.items()):
            handles[r] = check(
                cu.cuMemImportFromShareableHandle(
                    f, cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
                ),
                "cuMemImportFromShareableHandle",
            )
            os.close(f)
            del fds_in[r]
        va = check(cu.cuMemAddressReserve(W * stride, gran, 0, 0), "cuMemAddressReserve")  # alignment: granularity
        for r in range(W):
            check(cu.cuMemMap(cu.CUdeviceptr(int(va) + r * stride), stride, 0, handles[r], 0), "cuMemMap")
            mapped.append(r)
        desc = cu.CUmemAccessDesc()
        desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        desc.location.id = dev
        desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        check(cu.cuMemSetAccess(va, W * stride, [desc], 1), "cuMemSetAccess")
        whole = tensor_from_device_ptr(int(va), W * stride, dev)
        whole[info.rank * stride : (info.rank + 1) * stride].zero_()
        torch.cuda.synchronize(dev)
    except BaseException as e:  # noqa: BLE001
        err = e
    try:
        agree(info, err, "vmm allocation (map)")
    except BaseException:
        rollback()
        raise
    for h in handles.values():
        cu.cuMemRelease(h)
    handles.clear()

    base = int(va)
    addrs = [base + r * stride for r in range(W)]
    tensors = [whole[r * stride : r * stride + nbytes] for r in range(W)]

    def teardown() -> None:
        nonlocal va
        # When the barrier fails (a peer died) the mappings go anyway: the physical memory lives as long as some
        # process maps it, so a live peer's own mapping keeps what it may still touch.
        try:
            torch.cuda.synchronize(dev)
            agree(info, None, "vmm close (barrier)")
        finally:
            for r in range(W):
                check(cu.cuMemUnmap(cu.CUdeviceptr(base + r * stride), stride), "cuMemUnmap")
            check(cu.cuMemAddressFree(cu.CUdeviceptr(base), W * stride), "cuMemAddressFree")
            va = None

    buf = PeerBuffer(
        info=info,
        memory="vmm",
        nbytes=nbytes,
        device=torch.device("cuda", dev),
        peer_bytes=tensors,
        peer_addrs=addrs,
        teardown=teardown,
    )
    buf.stride = stride  # rank stride of the contiguous VA: peer r's bytes start at peer_addrs[0] + r*stride
    return buf
