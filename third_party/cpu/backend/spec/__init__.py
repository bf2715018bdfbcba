"""Spec of the CPU interpreter backend (``TRITON_INTERPRET=1``): libdevice that runs on a CPU.

Resolved for interpreted kernels (tritonspec picks ``cpu`` when TRITON_INTERPRET=1 and nothing
else is selected). It specializes one hook: ``interpreter_libdevice``, the numpy libdevice that
replaces the stock interpreter's ``NotImplementedError`` for extern calls.
"""
from tritonspec_backends.cpu.language.cpu import libdevice as interpreter_libdevice

_WHERE = "real"  # runs for real on this machine's CPU, through Triton's interpreter

__all__ = ["interpreter_libdevice"]
