"""Spec of the CPU interpreter backend (``TRITON_INTERPRET=1``): libdevice that runs on a CPU.

Resolved for interpreted kernels (it serves device type ``cpu``, which tritonspec picks when
TRITON_INTERPRET=1 and nothing else is selected). It specializes one hook: ``interpreter_libdevice``,
the numpy libdevice that replaces the stock interpreter's ``NotImplementedError`` for extern calls.
"""

from tritonspec import BackendInfo

backend_info = BackendInfo(runs="real", devices=("cpu",), note="Triton's interpreter on this machine's CPU")


def interpreter_libdevice():
    """The numpy libdevice, imported when a kernel is first interpreted."""
    from tritonspec_backends.cpu.language.cpu import libdevice

    return libdevice


__all__ = ["backend_info", "interpreter_libdevice"]
