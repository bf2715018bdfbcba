"""tritonspec's Triton MoE experts behind transformers' experts-function signature, and how the front ends
install them.

transformers' MoE families decorate their experts with ``use_experts_implementation``, which dispatches on
``config._experts_implementation`` and records the weights' layout on the module (``has_gate``, ``has_bias``,
``is_transposed``, ``is_concatenated``). :func:`tritonspec_experts_forward` is registered with
``ExpertsInterface`` as ``"tritonspec"`` (``register_experts()``; importing tritonspec.nn does it), and is what
the ``MoEExperts`` hub layer's forward runs. What the kernel does not cover (ungated or post-normed experts,
another activation, a layout other than Qwen/Mixtral/DeepSeek's and GPT-OSS's, an unsupported dtype) runs
transformers' ``grouped_mm`` path, so results never depend on which path ran. Expert-parallel sentinel ids
(``>= num_experts``, zero weights) contribute nothing on either path.

Why the front ends (kernelize, the registry, the YAML rules) go through transformers' switch: a replaced
``forward`` hides the class forward that reads the switch, so ``set_experts_implementation("eager")`` would be
silently ignored. So a :class:`Plan` collects what one front-end call chose for the experts transformers dispatches
(:func:`dispatched`) and, when every such module of the model gets ``MoEExperts``, sets
``experts_implementation="tritonspec"`` instead (recorded: ``revert`` restores the implementation from before);
``set_experts_implementation`` then switches away and back as usual. Where one config value cannot say what was
chosen (only some of the experts, another layer than ours, a model without the switch) the forward is replaced,
pinned to the implementation the config names then: switched to another one, it raises, naming what to do. Why
not run whatever the config names then: the pinned value is usually transformers' default (``grouped_mm``), so a
user comparing ``eager`` with ``grouped_mm`` would get ours in those modules under ``grouped_mm`` without knowing.
"""

from __future__ import annotations

from dataclasses import dataclass
import functools
from typing import Callable

import torch
from torch import nn

from ..devices import triton_runs
from . import engine

EXPERTS_NAME = "tritonspec"
_SWITCH = "_experts_implementation"  # the config attribute transformers' experts dispatch on
_GPU_DTYPES = (torch.float16, torch.bfloat16)
_CPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _ops():
    from ..ops import moe  # an import statement, not importlib: Dynamo traces it (fullgraph compiles)

    return moe


def _grouped_mm(*args, **kwargs):
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward(*args, **kwargs)


def _is_silu(act) -> bool:
    if isinstance(act, nn.SiLU):
        return True
    try:
        from transformers.activations import SiLUActivation
    except ImportError:
        return False
    return isinstance(act, SiLUActivation)


def experts_kind(module: nn.Module) -> tuple[str, str, float | None] | None:
    """(layout, activation, clamp) the Triton kernel computes ``module`` with, or None when it cannot.

    Read from what ``use_experts_implementation`` recorded and from the gate the class uses: transformers'
    default gate with a SiLU is ``"silu"``; GPT-OSS's own gate (``alpha`` 1.702, ``limit``) is ``"gpt_oss"``.
    """
    if not getattr(module, "has_gate", False) or getattr(module, "has_post_expert_norm", False):
        return None
    layout = {(True, False): "concatenated", (False, True): "interleaved_transposed"}.get(
        (getattr(module, "is_concatenated", None), getattr(module, "is_transposed", None))
    )
    if layout is None:
        return None
    from transformers.integrations.moe import _default_apply_gate

    gate = getattr(type(module), "_apply_gate", None)
    if gate is _default_apply_gate:
        return (layout, "silu", None) if _is_silu(getattr(module, "act_fn", None)) else None
    ops = _ops()
    limit = getattr(module, "limit", None)
    if (
        type(module).__module__.endswith(".gpt_oss.modeling_gpt_oss")
        and getattr(module, "alpha", None) == ops.GPT_OSS_ALPHA
        and isinstance(limit, (int, float))
        and limit > 0
    ):
        return layout, "gpt_oss", float(limit)
    return None


def tritonspec_experts_forward(
    module: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """transformers experts-function signature: (T, H) tokens, (T, k) ids and weights -> (T, H)."""
    kind = experts_kind(module)
    weight = module.gate_up_proj if kind is not None else None
    if (
        kind is None
        or hidden_states.dim() != 2
        or hidden_states.dtype not in (_GPU_DTYPES if hidden_states.device.type != "cpu" else _CPU_DTYPES)
        or weight.dtype != hidden_states.dtype
        or module.down_proj.dtype != hidden_states.dtype
        or not triton_runs(hidden_states.device.type)
    ):
        return _grouped_mm(module, hidden_states, top_k_index, top_k_weights)
    layout, activation, clamp = kind
    has_bias = getattr(module, "has_bias", False)
    return _ops().moe_experts(
        hidden_states,
        top_k_index,
        top_k_weights,
        module.gate_up_proj,
        module.down_proj,
        gate_up_bias=module.gate_up_proj_bias if has_bias else None,
        down_bias=module.down_proj_bias if has_bias else None,
        layout=layout,
        activation=activation,
        clamp=clamp,
    )


def register_experts(name: str = EXPERTS_NAME) -> str:
    """Register the experts function with transformers under ``name``; idempotent."""
    from transformers.integrations.moe import ExpertsInterface

    ExpertsInterface.register(name, tritonspec_experts_forward)
    return name


@functools.cache
def _dispatching_code():
    """The code of the forward ``use_experts_implementation`` gives a class: one code object for every class."""
    from transformers.integrations.moe import use_experts_implementation

    class Probe(nn.Module):
        def forward(self, *args):
            pass

    return use_experts_implementation(Probe).forward.__code__


def dispatched(module: nn.Module) -> bool:
    """Whether transformers picks ``module``'s experts function by ``config._experts_implementation``: its class
    forward is the one ``use_experts_implementation`` gives."""
    if not hasattr(getattr(module, "config", None), _SWITCH):
        return False
    try:
        return getattr(type(module).forward, "__code__", None) is _dispatching_code()
    except ImportError:
        return False


def pinned(forward: Callable, implementation, detail: str) -> Callable:
    """``forward`` for a dispatched experts module, running while its config names ``implementation``."""

    def run(module, *args, **kwargs):
        now = getattr(module.config, _SWITCH)
        if now != implementation:
            raise RuntimeError(
                f"{type(module).__name__}: experts_implementation is {now!r}, but tritonspec replaced this module's "
                f"forward while it was {implementation!r} ({detail}), and a replaced forward cannot follow the "
                f"switch. Set it back with model.set_experts_implementation({implementation!r}), or call "
                "tritonspec.nn.revert(model) first: then every implementation can be set"
            )
        return forward(module, *args, **kwargs)

    run.layer_forward, run.implementation, run.detail = forward, implementation, detail
    return run


@dataclass
class _Choice:
    path: str
    module: nn.Module
    forward: Callable | None  # a layer's forward taking the module as ``self``; None: the class forward
    kernel: str = ""
    source: str = ""
    detail: str = ""


class Plan:
    """What one front-end call chose for the experts transformers dispatches, installed by :meth:`apply` once it
    has chosen for every module (whether the switch can say it depends on all of them; see the module docstring).

    Call :meth:`apply` last in the front end's transaction: it may take back changes of earlier calls (their
    forwards, once the switch says the same; the switch, once it no longer can), which a rollback would not
    restore.
    """

    def __init__(self, model: nn.Module, source: str):
        self.model, self.source = model, source
        self.chosen: dict[int, _Choice] = {}

    def choose(self, path: str, module: nn.Module, forward: Callable, *, kernel: str, detail: str = "") -> None:
        """Run ``forward`` (a layer's, taking the module as ``self``) in ``module``."""
        forward = getattr(forward, "__func__", forward)
        self.chosen[id(module)] = _Choice(path, module, forward, kernel, self.source, detail)

    def keep(self, path: str, module: nn.Module) -> None:
        """Run ``module``'s class forward, as transformers' switch says (kernelize's fallback)."""
        self.chosen[id(module)] = _Choice(path, module, None)

    def _installed(self, path: str, module: nn.Module, switched: bool) -> _Choice | None:
        """What ``module`` runs now, as a choice; None for a forward someone else set (not ours to change)."""
        own = vars(module).get("forward")
        if own is None:
            if not switched:
                return _Choice(path, module, None)
            switch = engine.recorded(self.model, self.model.config, _SWITCH)
            return _Choice(path, module, _moe_forward(), switch.kernel, switch.source, switch.detail)
        change = engine.recorded(self.model, module, "forward")
        if change is None:
            return None
        fn = getattr(own, "__func__", own)
        detail = getattr(fn, "detail", change.detail)
        return _Choice(path, module, getattr(fn, "layer_forward", fn), change.kernel, change.source, detail)

    def apply(self) -> list[engine.Change]:
        """Install the choices: transformers' switch when it says them all, else pinned forwards."""
        if not self.chosen:
            return []
        model = self.model
        config = getattr(model, "config", None)
        switched = (
            getattr(config, _SWITCH, None) == EXPERTS_NAME and engine.recorded(model, config, _SWITCH) is not None
        )
        found = {id(m): (p, m) for p, m in model.named_modules() if dispatched(m)}
        found.update((k, (c.path, c.module)) for k, c in self.chosen.items() if k not in found)
        want = [self.chosen.get(k) or self._installed(p, m, switched) for k, (p, m) in found.items()]
        if all(c is not None and c.forward is _moe_forward() for c in want):
            change = self._switch([c.module for c in want], next(iter(self.chosen.values())))
            if change is not None:
                return [change]
        if switched:
            engine.restore(model, config, _SWITCH)  # the implementation from before; what ran ours is pinned below
        made = []
        for c in want:
            if c is None:
                continue
            if c.forward is None:
                engine.restore(model, c.module, "forward")
                continue
            implementation = getattr(c.module.config, _SWITCH)
            own = getattr(vars(c.module).get("forward"), "__func__", None)
            if getattr(own, "layer_forward", None) is c.forward and own.implementation == implementation:
                continue  # pinned so already
            made.append(
                engine.replace_forward(
                    model,
                    c.module,
                    pinned(c.forward, implementation, c.detail),
                    path=c.path,
                    kernel=c.kernel,
                    source=c.source,
                    detail=f"{c.detail}; while experts_implementation is {implementation!r}",
                )
            )
        return made

    def _switch(self, modules: list[nn.Module], choice: _Choice) -> engine.Change | None:
        """``experts_implementation="tritonspec"``, recorded, when the model has the switch and it reaches every
        one of ``modules`` (their replaced forwards go); else None and the model as it was."""
        model = self.model
        setter, config = getattr(model, "set_experts_implementation", None), getattr(model, "config", None)
        if setter is None or config is None:
            return None
        register_experts()
        getter = getattr(model, "get_experts_implementation", None)
        old = getter() if getter is not None else getattr(config, _SWITCH)
        setter(EXPERTS_NAME)
        if any(getattr(m.config, _SWITCH) != EXPERTS_NAME for m in modules):
            setter(old)
            return None
        change = engine.record_custom(
            model,
            config,
            _SWITCH,
            functools.partial(setter, old),
            path="",
            what="experts_implementation",
            kernel=choice.kernel,
            source=self.source,
            detail=choice.detail,
        )
        for m in modules:
            engine.restore(model, m, "forward")
        return change


def _moe_forward() -> Callable:
    """The ``MoEExperts`` hub layer's forward: what ``"tritonspec"`` runs, so the switch can stand in for it."""
    from .hub.layers import MoEExperts

    return MoEExperts.forward
