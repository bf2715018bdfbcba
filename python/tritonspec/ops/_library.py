"""How tritonspec ops become PyTorch operators: one declaration (``Op``), two autograd paths.

An op declares its forward, its backward and their fake (meta) versions once; from them come
* the eager path: a ``torch.autograd.Function`` that calls the launchers directly. A torch.library
  call costs tens of microseconds of dispatch (quack measured ~60 us against a ~10 us kernel), and
  eager RMSNorm / RoPE at Llama sizes are host-bound, so eager calls skip the dispatcher;
* the traced path: ``tritonspec::<name>_fwd`` / ``_bwd`` torch.library ops with their fakes and
  autograd, which torch.compile traces (``use_library_op``). ``torch.library.triton_op`` +
  ``wrap_triton`` keep the Triton kernels visible to Inductor, but they cannot trace interpreted
  kernels: with ``TRITON_INTERPRET=1`` (torch 2.13, triton 3.6 to 3.9) fake-tensor tracing reaches
  the interpreter, which reads data pointers and fails. There, and for ops that pass host TMA
  descriptors (``opaque=True``), the ops are opaque ``torch.library.custom_op``s with the same
  schema, fake and autograd.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from .. import settings
from ..devices import interpreting
from ..launch import on_arch_change
from ..specialization.providers import PROVIDERS
from ..specialization.resolve import selected, selection
from ._launch_cache import CachedLauncher

try:  # host-side TMA descriptors (Triton >= 3.4); interpreted too
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: the pointer paths still work
    TensorDescriptor = None

NAMESPACE = "tritonspec"

# Chosen once, like ``@triton.jit`` chooses JIT vs interpreter when the kernels are defined.
USE_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not interpreting()

# Eager CUDA launches reuse the compiled kernel without Triton's per-call binding (_launch_cache).
USE_CACHED_LAUNCH = settings.CACHED_LAUNCH.get()
_cached_launchers: dict = {}

# Tests set this to run eager calls through the registered ops as torch.compile would.
FORCE_LIBRARY_OP = False


def _schema_of(fn: Callable, what: str) -> inspect.Signature:
    """``fn``'s annotated signature without its keyword-only parameters (``traced``, ``in_place``): the
    op's schema, as torch.library infers it from a function (quack's ``torch_library_op`` does the same)."""
    sig = inspect.signature(fn, eval_str=True)
    params = [p for p in sig.parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    for p in params:
        if p.annotation is inspect.Parameter.empty or p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD:
            raise TypeError(f"{what}: parameter {p.name!r} needs a type annotation and must be positional")
    if sig.return_annotation is inspect.Signature.empty:
        raise TypeError(f"{what}: needs a return annotation (Tensor or tuple[Tensor, ...])")
    return sig.replace(parameters=params)


def _takes_same(fn: Callable, schema: inspect.Signature, what: str) -> None:
    names = [p.name for p in inspect.signature(fn).parameters.values() if p.kind is not inspect.Parameter.KEYWORD_ONLY]
    if names != list(schema.parameters):
        raise TypeError(f"{what}: takes ({', '.join(names)}), expected ({', '.join(schema.parameters)})")


def _optional(annotation) -> bool:
    return annotation == Optional[torch.Tensor]


def library_op(
    name: str, impl: Callable, fake: Callable, signature: inspect.Signature | None = None, *, opaque: bool = False
):
    """``tritonspec::<name>`` with ``signature`` (default: ``impl``'s annotated one): a triton_op (compiled Triton)
    or an opaque custom_op."""
    qualname = f"{NAMESPACE}::{name}"
    if signature is None:
        signature = _schema_of(impl, f"op {name!r}")
        _takes_same(fake, signature, f"op {name!r}: fake")
    impl.__signature__ = signature
    if USE_TRITON_OP and not opaque:
        op = torch.library.triton_op(qualname, impl, mutates_args=())
    else:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
    op.register_fake(fake)
    return op


def _as_tuple(outputs) -> tuple:
    return outputs if isinstance(outputs, tuple) else (outputs,)


class Op:
    """One op, declared once: the eager autograd path and the torch.library ops are derived from it.

    The schemas are the annotated signatures of ``forward`` and ``backward``, written once, in Python
    (their keyword-only parameters are not part of them).

    Args:
        name: the ops are ``tritonspec::<name>_fwd`` and ``tritonspec::<name>_bwd``.
        forward: ``(*inputs, *, traced) -> Tensor | tuple[Tensor, ...]``: the visible outputs first, then
            what only the backward needs (e.g. RMSNorm's rstd). ``Optional[Tensor]`` marks an input that
            may be None (it then gets no gradient).
        fake: the same computation on fake tensors (shapes and dtypes only), taking forward's inputs.
        save: ``(inputs, outputs) -> tensors`` the backward needs.
        statics: positions of the non-tensor inputs the backward needs too (e.g. causal, scale).
        backward: ``(*grads, *saved, *statics, *, in_place, traced) -> tuple[Tensor, ...]``, one grad per
            visible output (None for an unused one on the eager path: annotate it ``Optional[Tensor]``);
            ``in_place`` is the caller's ``in_place_backward``.
        backward_fake: the same on fake tensors, taking backward's positional parameters.
        grads: for each input, the index of its gradient among the backward's tensors (None: none).
        visible: how many leading outputs the caller gets.
        opaque: a custom_op even where kernels are compiled (host TMA descriptors, which
            torch.library's Triton kernel tracing does not take).
    """

    def __init__(
        self,
        name: str,
        *,
        forward: Callable,
        fake: Callable,
        save: Callable,
        backward: Callable,
        backward_fake: Callable,
        grads: tuple,
        statics: tuple = (),
        visible: int = 1,
        opaque: bool = False,
    ):
        signature = _schema_of(forward, f"Op {name!r}: forward")
        backward_signature = _schema_of(backward, f"Op {name!r}: backward")
        _takes_same(fake, signature, f"Op {name!r}: fake")
        _takes_same(backward_fake, backward_signature, f"Op {name!r}: backward_fake")
        n_grads, n_statics = visible, len(statics)
        single = getattr(signature.return_annotation, "__origin__", None) is not tuple
        self.name, self.visible, self.single = name, visible, single
        # Optional tensor inputs get no gradient when they are None.
        optional = frozenset(i for i, p in enumerate(signature.parameters.values()) if _optional(p.annotation))

        def forward_impl(*inputs):
            return forward(*inputs, traced=True)

        def backward_impl(*args):
            return backward(*args, in_place=False, traced=True)

        self.forward_op = library_op(f"{name}_fwd", forward_impl, fake, signature, opaque=opaque)
        self.backward_op = library_op(f"{name}_bwd", backward_impl, backward_fake, backward_signature, opaque=opaque)
        backward_op = self.backward_op

        def absent(inputs):
            return frozenset(p for p in optional if inputs[p] is None)

        def input_grads(none_inputs, results):
            return tuple(None if i is None or p in none_inputs else results[i] for p, i in enumerate(grads))

        # The backward runs where autograd runs it (a device thread for CUDA tensors), under the spec
        # selection the forward saw.
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*save(inputs, _as_tuple(output)))
            ctx.statics = tuple(inputs[i] for i in statics)
            ctx.selection = selection()
            ctx.absent = absent(inputs)

        def op_backward(ctx, *output_grads):
            with selected(ctx.selection):
                results = backward_op(*output_grads[:n_grads], *ctx.saved_tensors, *ctx.statics)
            return input_grads(ctx.absent, results)

        self.forward_op.register_autograd(op_backward, setup_context=setup_context)

        def function_forward(ctx, in_place, *inputs):
            outputs = _as_tuple(forward(*inputs, traced=False))
            ctx.save_for_backward(*save(inputs, outputs))
            ctx.statics = tuple(inputs[i] for i in statics) if n_statics else ()
            ctx.in_place = in_place
            ctx.selection = selection()
            ctx.absent = absent(inputs)
            ctx.set_materialize_grads(False)
            return outputs[0] if n_grads == 1 else outputs[:n_grads]

        def function_backward(ctx, *output_grads):
            with selected(ctx.selection):
                results = backward(*output_grads, *ctx.saved_tensors, *ctx.statics, in_place=ctx.in_place, traced=False)
            return (None, *input_grads(ctx.absent, results))

        # Named after the op (RmsNormFunction, ...: autograd names its nodes RmsNormFunctionBackward).
        self.Function = type(
            f"{''.join(w.capitalize() for w in name.split('_'))}Function",
            (torch.autograd.Function,),
            {
                "forward": staticmethod(function_forward),
                "backward": staticmethod(function_backward),
                "__module__": __name__,
            },
        )

    def __call__(self, *inputs, in_place_backward: bool = False):
        """Eager: the autograd Function (no dispatcher); traced by torch.compile: the library op."""
        if use_library_op():
            outputs = self.forward_op(*inputs)
            return outputs if self.single else outputs[0] if self.visible == 1 else outputs[: self.visible]
        return self.Function.apply(in_place_backward, *inputs)


def launcher(kernel, traced: bool):
    """The object to index with a grid: ``wrap_triton(kernel)`` inside a triton_op body, else the kernel.

    ``wrap_triton`` outside a triton_op would send eager launches through a higher-order op (~1 ms).
    """
    if traced and USE_TRITON_OP:
        return torch.library.wrap_triton(kernel)
    if interpreting() or not USE_CACHED_LAUNCH:
        return kernel
    cached = _cached_launchers.get(id(kernel))  # not hash(kernel): JITFunction hashes its source
    if cached is None:
        cached = _cached_launchers[id(kernel)] = CachedLauncher(kernel)
    return cached


_plan_caches: list = []


class PlanCache(dict):
    """An op's eager LaunchPlans by the op's key. Dropped, like launch_config's memo, when the spec
    registry or the backend selection changes, and when ``for_arch`` or ``recording`` begins or ends (a
    plan holds one arch's configs, and a recorded call must launch); bounded, since variable-length
    batches add one plan per shape (when full it starts over: a miss costs one ordinary launch)."""

    LIMIT = 512

    def __init__(self):
        super().__init__()
        PROVIDERS.on_change(self.clear)
        on_arch_change(self.clear)
        _plan_caches.append(self)

    def __setitem__(self, key, plan):
        if len(self) >= self.LIMIT and key not in self:
            self.clear()
        super().__setitem__(key, plan)

    def get(self, key, default=None):
        """The plan for ``key``; none while USE_CACHED_LAUNCH is off (every launch takes Triton's path)."""
        return super().get(key, default) if USE_CACHED_LAUNCH else default


@dataclass(frozen=True)
class Launch:
    """One launch an op asked for: the kernel, its grid, and its arguments as passed."""

    kernel: object
    grid: tuple
    args: tuple
    kwargs: dict


_recorded: list | None = None


@contextlib.contextmanager
def recording():
    """Launches are recorded into the yielded list instead of run. With meta tensors, an op's forward and
    backward then yield every Triton launch they make at any shape, with no device and no memory
    (``tritonspec check --kernels`` compiles them offline). The ops must not read results on the host."""
    global _recorded
    outer, _recorded = _recorded, []
    for plans in _plan_caches:  # a plan would relaunch without reaching launch()
        plans.clear()
    try:
        yield _recorded
    finally:
        _recorded = outer


def launch(kernel, grid, *args, traced: bool = False, plan: bool = False, **kwargs):
    """``launcher(kernel, traced)[grid](*args, **kwargs)``; with ``plan=True`` (eager calls) also
    returns the LaunchPlan that relaunches this compiled call, or None where there is none.

    Pass the kernel's arguments by name, grouped as its parameters are (pointers, sizes, strides,
    meta-parameters), so each value reads against its parameter.

    A traced launch goes without programmatic dependent launch: torch.library's Triton tracing (torch 2.11 to
    2.13) takes ``num_warps`` and ``num_stages`` as launch options but hands any other, ``launch_pdl`` too, to
    the kernel as an argument, which Inductor then fails on. The kernel's ``PDL`` constexpr (its waits) goes
    off with the option.
    """
    if traced and kwargs.get("launch_pdl"):
        kwargs = {**kwargs, "PDL": False}
        del kwargs["launch_pdl"]
    if _recorded is not None:
        _recorded.append(Launch(kernel, tuple(grid) if not callable(grid) else grid, args, kwargs))
        return None
    runner = launcher(kernel, traced)
    runner[grid](*args, **kwargs)
    if plan and isinstance(runner, CachedLauncher):
        return runner.plan(grid, args, kwargs)
    return None


def use_library_op() -> bool:
    """True while torch.compile traces (or a test forces it): call the ops, not the raw launchers."""
    return FORCE_LIBRARY_OP or torch.compiler.is_compiling()


# Host-side grid arithmetic. triton.cdiv / triton.next_power_of_2 are constexpr functions in
# triton 3.9 that unwrap their arguments on every host call (~5 us each on a slow host CPU), and
# eager launches of these memory-bound kernels are host-bound at Llama shapes.
def cdiv(a, b):
    return (a + b - 1) // b


def next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else 1


def tma_ok(*tensors: torch.Tensor) -> bool:
    """TMA needs a 16-byte aligned base, positive 16-byte multiple strides and a unit last stride.

    Transposed layouts (e.g. Hugging Face's (batch, seq, heads, dim).transpose(1, 2)) qualify: the
    4-D descriptor carries the strides, and the driver accepted them on an H100."""
    if TensorDescriptor is None:
        return False
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or (t.shape[-1] * t.element_size()) % 16:
            return False
        for stride in t.stride()[:-1]:
            if stride <= 0 or (stride * t.element_size()) % 16:
                return False
    return True


def derived(t: torch.Tensor, key, make: Callable):
    """``make()``, kept on tensor ``t`` under ``key`` until ``t`` changes in place: what the kernels
    derive from one batch's key bounds (padded rows, block tables) is built once for every layer of a
    model, not at each layer's call. Inference tensors keep no version count, and a traced one is not the
    call's: both get a fresh ``make()``."""
    if t.is_inference() or torch.compiler.is_compiling():
        return make()
    memo = getattr(t, "_tritonspec_derived", None)
    if memo is None or memo[0] != t._version:
        memo = (t._version, {})
        t._tritonspec_derived = memo
    value = memo[1].get(key)
    if value is None:
        value = memo[1][key] = make()
    return value
