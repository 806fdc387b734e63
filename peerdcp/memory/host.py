"""Host memory: one POSIX shared-memory segment per rank, mapped by every process of one host.

Protocol (each step agreed over the gloo group, all-or-nothing):
1. each rank creates ``/dev/shm/peerdcp-<uuid>-r<rank>`` (O_EXCL, 0600), sizes it, reserves its pages
   (``posix_fallocate``: a full /dev/shm is a PeerSetupError here, not a SIGBUS at the first store) and maps it;
2. names are all-gathered and every rank maps every peer's segment;
3. once every rank has mapped every segment, each rank unlinks its own: a crashed process then leaves
   nothing in /dev/shm, and the pages live exactly as long as some mapping does.
The fds are closed right after ``mmap``; ``close()`` is a barrier followed by ``munmap`` (which runs even when the
barrier fails).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import uuid

import torch

from .._runtime.groups import GroupInfo, agree, all_gather_object, hostname
from .buffer import PeerBuffer

__all__ = ["allocate_host", "SHM_DIR", "SHM_PREFIX"]

SHM_DIR = "/dev/shm"
SHM_PREFIX = "peerdcp-"
_PAGE = mmap.PAGESIZE

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED = ctypes.c_void_p(-1).value


def _map_fd(fd: int, size: int) -> int:
    addr = _libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
    if addr is None or addr == _MAP_FAILED:
        err = ctypes.get_errno()
        raise OSError(err, f"mmap of {size} bytes failed: {os.strerror(err)}")
    return int(addr)


def _unmap(addr: int, size: int) -> None:
    if _libc.munmap(ctypes.c_void_p(addr), size) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"munmap failed: {os.strerror(err)}")


def _bytes_tensor(addr: int, size: int) -> torch.Tensor:
    # A ctypes array over the mapping exposes the buffer protocol; torch.frombuffer aliases it.
    arr = (ctypes.c_uint8 * size).from_address(addr)
    return torch.frombuffer(arr, dtype=torch.uint8, count=size)


def allocate_host(info: GroupInfo, nbytes: int, *, fault: str | None = None) -> PeerBuffer:
    """Collective host-memory allocation (see module docstring). ``fault`` names a stage at which this
    rank raises, for tests of the all-or-nothing rollback ("create", "map", "unlink")."""
    size = max(_PAGE, -(-nbytes // _PAGE) * _PAGE)
    host = hostname()
    hosts = all_gather_object(info, host)
    if len(set(hosts)) != 1:
        agree(info, f"host memory needs one host, group spans {sorted(set(hosts))}", "host allocation")

    mapped: dict[int, int] = {}
    path: str | None = None
    linked = False

    def rollback() -> None:
        for addr in mapped.values():
            try:
                _unmap(addr, size)
            except OSError:
                pass
        mapped.clear()
        if path is not None and linked:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass

    # 1. create and map our own segment
    err: BaseException | None = None
    try:
        path = os.path.join(SHM_DIR, f"{SHM_PREFIX}{uuid.uuid4().hex}-r{info.rank}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        linked = True
        try:
            os.ftruncate(fd, size)
            # reserve the pages now: tmpfs sizes a file sparsely, and a store into a page a full /dev/shm cannot
            # back kills the process with SIGBUS (Docker's default /dev/shm is 64 MiB); this fails here instead
            os.posix_fallocate(fd, 0, size)
            mapped[info.rank] = _map_fd(fd, size)
        finally:
            os.close(fd)
        if fault == "create":
            raise RuntimeError("injected fault at stage 'create'")
    except BaseException as e:  # noqa: BLE001 - reported to every rank, then re-raised as PeerSetupError
        err = e
    names = all_gather_object(info, path if err is None else None)
    try:
        agree(info, err, "host allocation (create)")
    except BaseException:
        rollback()
        raise

    # 2. map every peer's segment
    err = None
    try:
        for r, name in enumerate(names):
            if r == info.rank:
                continue
            fd = os.open(name, os.O_RDWR)
            try:
                if os.fstat(fd).st_size != size:
                    raise ValueError(f"segment of rank {r} has {os.fstat(fd).st_size} bytes, expected {size}")
                mapped[r] = _map_fd(fd, size)
            finally:
                os.close(fd)
        if fault == "map":
            raise RuntimeError("injected fault at stage 'map'")
    except BaseException as e:  # noqa: BLE001
        err = e
    try:
        agree(info, err, "host allocation (map)")
    except BaseException:
        rollback()
        raise

    # 3. everyone holds every mapping: the names are no longer needed
    os.unlink(path)
    linked = False
    try:
        agree(info, "injected fault at stage 'unlink'" if fault == "unlink" else None, "host allocation (unlink)")
    except BaseException:
        rollback()
        raise

    addrs = [mapped[r] for r in range(info.world_size)]
    tensors = [_bytes_tensor(a, size)[:nbytes] for a in addrs]

    def teardown() -> None:
        # No peer may still be storing into our segment or reading theirs. When the barrier fails (a peer died) the
        # mappings go anyway: a live peer's own mapping keeps the pages it may still touch.
        try:
            agree(info, None, "host close (barrier)")
        finally:
            for a in addrs:
                _unmap(a, size)

    return PeerBuffer(
        info=info,
        memory="host",
        nbytes=nbytes,
        device=torch.device("cpu"),
        peer_bytes=tensors,
        peer_addrs=addrs,
        teardown=teardown,
    )
