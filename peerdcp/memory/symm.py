"""PyTorch symmetric memory (``torch.distributed._symmetric_memory``: ``empty`` + ``rendezvous``).

Peer addresses come from the handle: ``buffer_ptrs[r]`` is the base of rank r's *block*; our tensor may
sit at an offset inside it (torch >= 2.11 allocates from an implicit MemPool), so every peer address is
``buffer_ptrs[r] + offset`` with ``offset = tensor.data_ptr() - buffer_ptrs[rank]`` (equal to
``handle.offset`` where the handle has it). Works on torch 2.9 - 2.14.
"""

from __future__ import annotations

import torch

from .._runtime.checks import cuda_index
from .._runtime.groups import GroupInfo, agree
from .buffer import PeerBuffer

__all__ = ["allocate_symm"]


def allocate_symm(info: GroupInfo, nbytes: int, device: torch.device) -> PeerBuffer:
    import torch.distributed as dist
    import torch.distributed._symmetric_memory as symm_mem

    dev = cuda_index(device)
    torch.cuda.set_device(dev)
    err: BaseException | None = None
    t = hdl = None
    try:
        t = symm_mem.empty(nbytes, dtype=torch.uint8, device=torch.device("cuda", dev))
        t.zero_()
        torch.cuda.synchronize(dev)
    except BaseException as e:  # noqa: BLE001
        err = e
    agree(info, err, "symm allocation (empty)")
    err = None
    try:
        group = info.group
        name = group.group_name if hasattr(group, "group_name") else dist.distributed_c10d._get_group_name(group)
        hdl = symm_mem.rendezvous(t, name)
        offset = t.data_ptr() - int(hdl.buffer_ptrs[info.rank])
        if hasattr(hdl, "offset") and int(hdl.offset) != offset:
            raise RuntimeError(f"symmetric-memory offset mismatch: handle says {hdl.offset}, tensor says {offset}")
        addrs = [int(p) + offset for p in hdl.buffer_ptrs]
        tensors = [
            t if r == info.rank else hdl.get_buffer(r, [nbytes], torch.uint8, offset) for r in range(info.world_size)
        ]
    except BaseException as e:  # noqa: BLE001
        err = e
    agree(info, err, "symm allocation (rendezvous)")

    def teardown() -> None:
        nonlocal t, hdl
        try:
            torch.cuda.synchronize(dev)
            agree(info, None, "symm close (barrier)")
        finally:  # (also when the barrier fails: a peer died)
            # Dropping the last references frees this rank's block and its mappings of the peers' blocks.
            t = hdl = None
            tensors.clear()
            buf._symm_handle = None  # (PeerBuffer.close then waits until every rank has released)

    buf = PeerBuffer(
        info=info,
        memory="symm",
        nbytes=nbytes,
        device=torch.device("cuda", dev),
        peer_bytes=tensors,
        peer_addrs=addrs,
        teardown=teardown,
    )
    buf._symm_handle = hdl  # keeps the peer mappings alive
    return buf
