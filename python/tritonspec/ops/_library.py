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

import inspect
import os
from typing import Callable, Optional

import torch

from ..devices import interpreting
from ..registry import REGISTRY
from ..resolve import selected, selection
from ._launch_cache import CachedLauncher

NAMESPACE = "tritonspec"

# Chosen once, like ``@triton.jit`` chooses JIT vs interpreter when the kernels are defined.
USE_TRITON_OP = hasattr(torch.library, "triton_op") and hasattr(torch.library, "wrap_triton") and not interpreting()

# Eager CUDA launches reuse the compiled kernel without Triton's per-call binding (_launch_cache).
USE_CACHED_LAUNCH = os.environ.get("TRITONSPEC_CACHED_LAUNCH", "1") == "1"
_cached_launchers: dict = {}

# Tests set this to run eager calls through the registered ops as torch.compile would.
FORCE_LIBRARY_OP = False


_SCHEMA_TYPES = {"Tensor": torch.Tensor, "Tensor?": Optional[torch.Tensor], "float": float, "bool": bool, "int": int,
                 "str": str}


def _with_signature(fn: Callable, schema: str) -> Callable:
    """``fn(*args)`` with the annotated signature ``schema`` describes: torch.library infers an op's
    schema from its function (triton_op always does), so the schema is written once, as a string."""
    args, returns = (part.strip() for part in schema.split("->"))
    params = []
    for arg in filter(None, (a.strip() for a in args.strip("()").split(","))):
        kind, name = arg.split()
        params.append(inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=_SCHEMA_TYPES[kind]))
    if returns.startswith("("):
        ret = tuple.__class_getitem__(tuple(_SCHEMA_TYPES[r.strip()] for r in returns.strip("()").split(",")))
    else:
        ret = _SCHEMA_TYPES[returns]
    fn.__signature__ = inspect.Signature(params, return_annotation=ret)
    return fn


def library_op(name: str, schema: str, impl: Callable, fake: Callable, *, opaque: bool = False):
    """``tritonspec::<name>`` with ``schema``: a triton_op (compiled Triton) or an opaque custom_op."""
    qualname = f"{NAMESPACE}::{name}"
    impl = _with_signature(impl, schema)
    if USE_TRITON_OP and not opaque:
        op = torch.library.triton_op(qualname, impl, mutates_args=())
    else:
        op = torch.library.custom_op(qualname, impl, mutates_args=())
    op.register_fake(fake)
    return op


class Op:
    """One op, declared once: the eager autograd path and the torch.library ops are derived from it.

    Args:
        name: the ops are ``tritonspec::<name>_fwd`` and ``tritonspec::<name>_bwd``.
        schema / backward_schema: torch.library schemas of the two (inputs; then grads, saved, statics).
        forward: ``(*inputs, traced) -> outputs`` (a tuple of tensors: the visible ones first, then
            what only the backward needs, e.g. RMSNorm's rstd).
        fake, backward_fake: the same computations on fake tensors (shapes and dtypes only); forward
            and fake return tuples even where the schema returns one Tensor.
        save: ``(inputs, outputs) -> tensors`` the backward needs; ``saves`` says how many.
        statics: positions of the non-tensor inputs the backward needs too (e.g. causal, scale).
        backward: ``(grads, saved, statics, *, in_place, traced) -> tensors``. A grad is None for an
            unused output on the eager path; ``in_place`` is the caller's ``in_place_backward``.
        grads: for each input, the index of its gradient among the backward's tensors (None: none).
            An optional tensor input (``Tensor?``) that is None gets None whatever the backward returns.
        visible: how many leading outputs the caller gets.
        opaque: a custom_op even where kernels are compiled (host TMA descriptors, which
            torch.library's Triton kernel tracing does not take).
    """

    def __init__(self, name: str, *, schema: str, forward: Callable, fake: Callable, save: Callable, saves: int,
                 backward_schema: str, backward: Callable, backward_fake: Callable, grads: tuple,
                 statics: tuple = (), visible: int = 1, opaque: bool = False):
        n_grads, n_statics = visible, len(statics)
        # A schema returning one Tensor (not a tuple) gets forward's single output.
        single = not schema.split("->")[1].strip().startswith("(")
        self.name, self.visible, self.single = name, visible, single

        def forward_impl(*inputs):
            outputs = forward(*inputs, traced=True)
            return outputs[0] if single else outputs

        def fake_impl(*inputs):
            outputs = fake(*inputs)
            return outputs[0] if single else outputs

        def backward_impl(*args):
            return backward(args[:n_grads], args[n_grads:n_grads + saves], args[n_grads + saves:],
                            in_place=False, traced=True)

        def backward_fake_impl(*args):
            return backward_fake(args[:n_grads], args[n_grads:n_grads + saves], args[n_grads + saves:])

        self.forward_op = library_op(f"{name}_fwd", schema, forward_impl, fake_impl, opaque=opaque)
        self.backward_op = library_op(f"{name}_bwd", backward_schema, backward_impl, backward_fake_impl,
                                      opaque=opaque)
        backward_op = self.backward_op

        # Optional tensor inputs (Tensor? in the schema) get no gradient when they are None.
        optional = frozenset(i for i, arg in enumerate(schema.split("->")[0].strip("( )").split(","))
                             if arg.strip().startswith("Tensor?"))

        def absent(inputs):
            return frozenset(p for p in optional if inputs[p] is None)

        def input_grads(none_inputs, results):
            return tuple(None if i is None or p in none_inputs else results[i] for p, i in enumerate(grads))

        # The backward runs where autograd runs it (a device thread for CUDA tensors), under the spec
        # selection the forward saw.
        def setup_context(ctx, inputs, output):
            ctx.save_for_backward(*save(inputs, (output,) if single else output))
            ctx.statics = tuple(inputs[i] for i in statics)
            ctx.selection = selection()
            ctx.absent = absent(inputs)

        def op_backward(ctx, *output_grads):
            with selected(ctx.selection):
                results = backward_op(*output_grads[:n_grads], *ctx.saved_tensors, *ctx.statics)
            return input_grads(ctx.absent, results)

        self.forward_op.register_autograd(op_backward, setup_context=setup_context)

        def function_forward(ctx, in_place, *inputs):
            outputs = forward(*inputs, traced=False)
            ctx.save_for_backward(*save(inputs, outputs))
            ctx.statics = tuple(inputs[i] for i in statics) if n_statics else ()
            ctx.in_place = in_place
            ctx.selection = selection()
            ctx.absent = absent(inputs)
            ctx.set_materialize_grads(False)
            return outputs[0] if n_grads == 1 else outputs[:n_grads]

        def function_backward(ctx, *output_grads):
            with selected(ctx.selection):
                results = backward(output_grads, ctx.saved_tensors, ctx.statics, in_place=ctx.in_place, traced=False)
            return (None, *input_grads(ctx.absent, results))

        # Named after the op (RmsNormFunction, ...: autograd names its nodes RmsNormFunctionBackward).
        self.Function = type(f"{''.join(w.capitalize() for w in name.split('_'))}Function", (torch.autograd.Function,),
                             {"forward": staticmethod(function_forward), "backward": staticmethod(function_backward),
                              "__module__": __name__})

    def __call__(self, *inputs, in_place_backward: bool = False):
        """Eager: the autograd Function (no dispatcher); traced by torch.compile: the library op."""
        if use_library_op():
            outputs = self.forward_op(*inputs)
            return outputs if self.single else outputs[0] if self.visible == 1 else outputs[:self.visible]
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


class PlanCache(dict):
    """An op's eager LaunchPlans by the op's key. Dropped, like launch_config's memo, when the spec
    registry or the backend selection changes; bounded, since variable-length batches add one plan
    per shape (when full it starts over: a miss costs one ordinary launch)."""

    LIMIT = 512

    def __init__(self):
        super().__init__()
        REGISTRY.on_change(self.clear)

    def __setitem__(self, key, plan):
        if len(self) >= self.LIMIT and key not in self:
            self.clear()
        super().__setitem__(key, plan)

    def get(self, key, default=None):
        """The plan for ``key``; none while USE_CACHED_LAUNCH is off (every launch takes Triton's path)."""
        return super().get(key, default) if USE_CACHED_LAUNCH else default


def launch(kernel, grid, args: tuple, kwargs: dict, *, traced: bool = False, plan: bool = False):
    """``launcher(kernel, traced)[grid](*args, **kwargs)``; with ``plan=True`` (eager calls) also
    returns the LaunchPlan that relaunches this compiled call, or None where there is none."""
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
