"""A pytest plugin that runs a test suite with every Hugging Face model kernelized by tritonspec: transformers'
own model tests, or yours, against our kernels without changing a test.

    PYTHONPATH=examples/transformers_tests pytest -p kernelize_plugin tests/models/llama/test_modeling_llama.py

On the first call of a ``PreTrainedModel`` (the outermost one; the models inside it are marked too), outside
torch.compile's tracing: ``kernelize(model, mode=Mode.TRAINING)``, and, where the model ran SDPA, our attention
(``attn_implementation="tritonspec"``, as ``apply_available_kernels`` chooses it). An error of either fails the
test that called the model, which is left as it was built. Switches the test makes afterwards
(``set_experts_implementation``, ``set_attn_implementation``) act as they do on any model.
"""

from __future__ import annotations

import torch
from torch import nn

KERNELIZED = "_tritonspec_kernelized"  # set in a model's __dict__ once it was kernelized (or is being)


def kernelize_once(model) -> None:
    """Kernelize ``model`` unless it (or a model containing it) already was."""
    import tritonspec.nn as tnn
    from transformers import PreTrainedModel

    if model.__dict__.get(KERNELIZED) or torch.compiler.is_compiling():
        return
    for module in model.modules():  # first: kernelize may call the model
        if isinstance(module, PreTrainedModel):
            module.__dict__[KERNELIZED] = True
    sdpa = getattr(model.config, "_attn_implementation", None) == "sdpa"
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    try:
        if sdpa:
            tnn.use_tritonspec_attention(model, source="kernelize_plugin")
    except BaseException:
        tnn.revert(model)  # all or nothing: the model as the test built it
        raise


def pytest_configure(config):
    from transformers import PreTrainedModel

    if getattr(PreTrainedModel.__call__, "kernelizes", False):
        return
    call = nn.Module.__call__

    def __call__(self, *args, **kwargs):
        kernelize_once(self)
        return call(self, *args, **kwargs)

    __call__.kernelizes = True
    PreTrainedModel.__call__ = __call__
