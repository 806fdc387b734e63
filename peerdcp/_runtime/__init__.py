"""The ground floor every other part of peerdcp stands on; it imports nothing above it.

``device``     every GPU-only instruction behind one helper (Triton's peer loads/stores, waits, the error word,
               SM counts, stream handles), with the interpreter's host-memory twins
``groups``     process groups: the CPU twin of a device group, agreement across ranks, bounded collectives
``checks``     argument checks shared by the public classes (devices, integers, timeouts)
``jit``        the CUDA C++ libraries of ``csrc/``: built with nvcc at first use, loaded with ctypes
``lifecycle``  the base of every public class: ``check``, ``close``, the context manager, refusal after a timeout
"""
