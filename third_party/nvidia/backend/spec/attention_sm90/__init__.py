"""Hopper's attention forward and backward: warp-specialized Gluon kernels the ``tl`` kernels cannot express.

The op asks for them through the ``attention_forward`` / ``attention_backward`` hooks, with the key bounds
of padded, packed and sliding-window batches where there are some (not with GPT-OSS's sinks); both decline
(return False, the op then runs its ``tl`` kernels) for anything they were not measured on: a device
other than sm90, head_dim outside 64..128, dtypes other than fp16/bf16, scale <= 0, strides TMA cannot
address, more than 65535 batch x heads, decode-sized queries (forward), or a Triton without Gluon's
Hopper API. The backward takes a problem by returning its launch, which the op runs once it has zeroed
the dQ accumulator: a declined problem costs no accumulator.

Modules:
    ``forward``       the persistent forward kernel (why it beats the portable one, measured);
    ``backward``      the one-pass backward kernel, dQ by TMA reduce-adds;
    ``schedule``      host-side choices of how the work is cut up: tiles, warpgroups, registers, the
                      forward's per-CTA tile lists, and under key bounds each tile's blocks (tested offline);
    ``launchers``     the hooks: eligibility, TMA descriptors, launches and their plans;
"""
