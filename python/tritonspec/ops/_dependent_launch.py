"""What a decode-step kernel does before its wait under programmatic dependent launch (sm90+).

A kernel launched with ``launch_pdl`` (its config's ``PDL``) may start while the kernel before it still runs:
it must call ``gdc_wait()`` before it reads anything that kernel may write, or writes anything it may read.
Until then it can only warm L2 with data it will read anyway, which is what :func:`prefetch_l2` does (a stale
line costs nothing: L2 is where the earlier kernel's writes land). After its last loads it calls
``gdc_launch_dependents()``, so the next such kernel starts while this one stores.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def prefetch_l2(ptrs):
    """PTX ``prefetch.global.L2``: each address's line into L2, nothing waited on (sm90 under PDL only)."""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)
