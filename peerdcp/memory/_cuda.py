"""Lazy access to the CUDA driver API (cuda-python) and small helpers around it.

Nothing here is imported at package import time: a machine without a CUDA driver or without
cuda-python still imports peerdcp, and the probe reports why the GPU kinds are ineligible.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import torch

__all__ = ["driver", "check", "CudaError", "tensor_from_device_ptr"]


class CudaError(RuntimeError):
    pass


@functools.cache
def driver() -> Any:
    """The ``cuda.bindings.driver`` module (cuda-python >= 12.6), initialised; raises ImportError/CudaError."""
    try:
        from cuda.bindings import driver as cu  # cuda-python >= 12.6
    except ImportError:  # pragma: no cover - older layout
        from cuda import cuda as cu  # type: ignore[no-redef]
    (err,) = cu.cuInit(0)
    if int(err) != 0:
        raise CudaError(f"cuInit failed: {_name(cu, err)}")
    return cu


def _name(cu: Any, err: Any) -> str:
    try:
        _, s = cu.cuGetErrorName(err)
        return s.decode() if isinstance(s, bytes) else str(s)
    except Exception:  # noqa: BLE001
        return str(err)


def check(result: Any, what: str) -> Any:
    """Unpack a cuda-python ``(err, *values)`` tuple; raise :class:`CudaError` naming ``what`` on error."""
    cu = driver()
    if isinstance(result, tuple):
        err, rest = result[0], result[1:]
    else:
        err, rest = result, ()
    if int(err) != 0:
        raise CudaError(f"{what} failed: {_name(cu, err)}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else rest


# --- DLPack: a CUDA tensor over raw device memory, with an explicit device id -----------------------
# (torch.as_tensor on __cuda_array_interface__ would infer the device from the pointer, which for a
#  peer's physical memory mapped into our VA can name the peer's device.)


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

_pycapsule_new = ctypes.pythonapi.PyCapsule_New
_pycapsule_new.restype = ctypes.py_object
_pycapsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]

# The DLManagedTensor structs must outlive every tensor made from them; they are a few dozen bytes.
_KEEPALIVE: list[object] = []


def tensor_from_device_ptr(ptr: int, nbytes: int, device_index: int) -> torch.Tensor:
    """A ``uint8 [nbytes]`` CUDA tensor on ``cuda:device_index`` aliasing ``ptr`` (memory not owned)."""
    shape = (ctypes.c_int64 * 1)(nbytes)
    mt = _DLManagedTensor()
    mt.dl_tensor.data = ctypes.c_void_p(ptr)
    mt.dl_tensor.device = _DLDevice(2, device_index)  # kDLCUDA
    mt.dl_tensor.ndim = 1
    mt.dl_tensor.dtype = _DLDataType(1, 8, 1)  # kDLUInt, 8 bits
    mt.dl_tensor.shape = shape
    mt.dl_tensor.strides = None
    mt.dl_tensor.byte_offset = 0
    mt.manager_ctx = None
    mt.deleter = _DELETER()
    _KEEPALIVE.append((mt, shape))
    capsule = _pycapsule_new(ctypes.addressof(mt), b"dltensor", None)
    return torch.utils.dlpack.from_dlpack(capsule)
