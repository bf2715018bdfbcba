"""Which modules of a Hugging Face model a kernel of the kernel table replaces.

The detectors here (``is_rms_norm``, ``is_swiglu_mlp``, ``is_rotate_half_rope``) are what the table's entries name; the
functions below read the table to find, for any declared kernel, the modules it recognizes and the
module-level functions (``apply_rotary_pos_emb``) the model's classes call.

Why structural checks and not only transformers' ``kernel_layer_name`` tags: the tags exist only when
transformers accepts the installed ``kernels`` version (transformers 5.23 wants kernels >=0.18.2,<0.19, so
with kernels 0.17.2 nothing is tagged), and even then MLPs such as ``LlamaMLP`` carry no ``SwiGLUMLP`` tag.
The checks look at what the replacement layer relies on (attributes, child modules, the activation, the
names the original ``forward`` uses), not at per-model class tables that break on every release.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
import types
import weakref

from torch import nn

# RMSNorm classes whose math differs from Llama's (1 + weight, gating, zero-centred weight).
RMS_NORM_EXCLUDE = ("Gemma", "Gated", "ZeroCentered")
_SILU_NAMES = {"SiLU", "SiLUActivation"}


def _forward_names(cls) -> set[str]:
    fwd = getattr(cls, "forward", None)
    code = getattr(fwd, "__code__", None)
    return set(code.co_names) if code is not None else set()


def is_rms_norm(module: nn.Module, exclude: tuple[str, ...] = RMS_NORM_EXCLUDE) -> bool:
    """An HF Llama-style RMSNorm: ``*RMSNorm`` with a 1-D ``weight``, a float ``variance_epsilon``, no children."""
    cls = type(module)
    name = cls.__name__
    if not name.endswith("RMSNorm") or any(x in name for x in exclude):
        return False
    w = module._parameters.get("weight")
    return (w is not None and w.dim() == 1 and set(module._parameters) == {"weight"} and not module._modules
            and isinstance(getattr(module, "variance_epsilon", None), float)
            and {"variance_epsilon", "weight"} <= _forward_names(cls))


def is_swiglu_mlp(module: nn.Module) -> bool:
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``: the three Linear children, a SiLU ``act_fn``, nothing else."""
    mods = module._modules
    if set(mods) - {"act_fn"} != {"gate_proj", "up_proj", "down_proj"}:
        return False
    if not all(isinstance(mods[n], nn.Linear) for n in ("gate_proj", "up_proj", "down_proj")):
        return False
    act = getattr(module, "act_fn", None)
    if act is None or type(act).__name__ not in _SILU_NAMES:
        return False
    return {"gate_proj", "up_proj", "down_proj", "act_fn"} <= _forward_names(type(module))


def tagged_name(obj) -> str | None:
    """The layer name a ``use_kernel_forward_from_hub`` decorator (ours, kernels', transformers') put on the class."""
    name = getattr(type(obj), "kernel_layer_name", None)
    return str(name) if name is not None else None


_ROTARY_PROBES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per function: probed once, not kept alive


def is_rotate_half_rope(fn) -> bool:
    """Whether a model's ``apply_rotary_pos_emb`` (a function, or kernels' ``Func`` module) is the
    rotate-half formula with cos/sin as wide as the head that the RoPE layer computes.

    Models share the name, not the math (GPT-OSS's takes half-width cos/sin; GLM's interleaves), so the
    function is run once on a small float64 probe and compared with the reference.
    """
    try:
        return _ROTARY_PROBES[fn]
    except (KeyError, TypeError):  # not probed yet, or not weak-referenceable (probed every time)
        pass
    import torch
    from ..ops.rope import rope_ref
    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, h, 3, 8, generator=g, dtype=torch.float64) for h in (2, 1))
    cos, sin = (torch.randn(1, 3, 8, generator=g, dtype=torch.float64) for _ in range(2))
    call = (lambda *a: type(fn).forward(fn, *a)) if isinstance(fn, nn.Module) else fn
    try:
        with torch.no_grad():
            got = call(q, k, cos, sin)
        ok = all(isinstance(a, torch.Tensor) and a.shape == b.shape and torch.allclose(a, b)
                 for a, b in zip(got, rope_ref(q, k, cos, sin), strict=True))
    except Exception:  # noqa: BLE001 - a function that cannot take the probe is not this formula
        ok = False
    with contextlib.suppress(TypeError):
        _ROTARY_PROBES[fn] = ok
    return ok


def infer_layer_name(module: nn.Module) -> str | None:
    """The layer name of the first declared kernel that recognizes an untagged module (by class name,
    then by its structural detector), else None."""
    from ..kernel_table import KERNELS
    name = type(module).__name__
    for kernel in KERNELS.values():
        layer = kernel.layer
        if kernel.site != "module" or layer is None:
            continue
        if name in layer.classes:
            return layer.name
        detect = layer.detector()
        if detect is not None and detect(module):
            return layer.name
    return None


def function_sites(model: nn.Module) -> list[tuple[object, types.ModuleType, str, object]]:
    """(kernel, python module, attribute, original value) for each module-level function a declared
    kernel replaces (``site="function"``) that the model's classes call, once per python module.

    The original is a plain function when transformers built the model without ``kernels``, or the
    ``Func`` module the kernels decorator made; where the layer declares a detector, only originals it
    accepts are listed. If a front end has already replaced the global, it
    is the value that front end replaced, so re-running a front end works.
    """
    from ..kernel_table import KERNELS
    from .engine import shared_original
    out = []
    classes = {type(m) for m in model.modules()}
    for kernel in KERNELS.values():
        if kernel.site != "function":
            continue
        attr = kernel.layer.function
        seen = set()
        for cls in classes:
            if attr not in _forward_names(cls):
                continue
            pymod = sys.modules.get(cls.__module__)
            fn = shared_original(pymod, attr, getattr(pymod, attr, None))
            if fn is None or id(pymod) in seen:
                continue
            if not (inspect.isfunction(fn) or isinstance(fn, nn.Module)):
                continue
            detect = kernel.layer.detector()
            if detect is not None and not detect(fn):
                continue
            seen.add(id(pymod))
            out.append((kernel, pymod, attr, fn))
    return out
