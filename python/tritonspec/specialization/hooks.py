"""The declared hook table: every name a backend may specialize, declared once.

Mainline call sites and spec modules both go through this table, so a typo is an error
with a suggestion instead of a silent fallback to the default (FlagTree's weak spot), and
upgrading Triton means re-validating this one file against the new release.
"""

from __future__ import annotations

import enum
import inspect
import types
from dataclasses import dataclass
from typing import Callable


class Kind(enum.Enum):
    VALUE = "value"  # the spec returns a value (or is a constant); None means "use the default"
    PREDICATE = "predicate"  # the spec returns True to specialize; the default is False
    FUNCTION = "function"  # the spec is a replacement function, fetched with spec_func()


class SpecError(LookupError):
    """A hook or spec module that does not match the declared table."""


class SpecContractError(SpecError, ValueError):
    """A specialization of the wrong kind or range; names the backend, the hook and what was expected."""


# -- contracts ---------------------------------------------------------------------------------------
# A function hook's call is declared as an annotated signature (the point calls it with exactly
# these parameters); a checker turns a value, or a function's result, into None (fine) or what was
# expected. Both are checked where a specialization is looked up, so a wrong value fails with the
# backend and hook named instead of deep inside Triton.

Check = Callable[[object], "str | None"]


def _got(x) -> str:
    return f"{type(x).__name__} {x!r}" if isinstance(x, (str, int, float)) else type(x).__name__


def _int_at_least(lo: int) -> Check:
    def check(x):
        if isinstance(x, bool) or not isinstance(x, int) or x < lo:
            return f"an int >= {lo}, got {_got(x)}"

    return check


def _is(*types_: type, none: bool = False) -> Check:
    names = " or ".join(t.__name__ for t in types_) + (" or None" if none else "")

    def check(x):
        if (x is None and none) or (isinstance(x, types_) and not (bool not in types_ and isinstance(x, bool))):
            return None
        return f"{names}, got {_got(x)}"

    return check


def _cache_modifier(x):
    if x is not None and type(x).__name__ != "CACHE_MODIFIER":
        return f"an ir.CACHE_MODIFIER or None, got {_got(x)}"


def _timings(x):
    if isinstance(x, bool) or not (
        isinstance(x, (int, float)) or isinstance(x, (list, tuple)) and all(isinstance(v, (int, float)) for v in x)
    ):
        return f"a time in ms (float) or a list of them, got {_got(x)}"


def _none(x):
    if x is not None:
        return f"None (it edits the stages in place), got {_got(x)}"


def _runner_or_decline(x):
    # True reads as "ran" but leaves the op nothing to call: an error, not a decline
    if x is not None and x is not False and (isinstance(x, bool) or not callable(x)):
        return f"False or None (decline) or a function to run, got {_got(x)}"


# The calls function hooks receive, as annotated signatures (the bodies are never run).
def atomic_add_int64_call(semantic, ptr, val, mask, sem, scope): ...
def cache_modifier_call(cache_modifier: str): ...
def pipeline_stages_call(backend, stages: dict, options, language, capability) -> None: ...
def prune_configs_call(configs: list, named_args: dict) -> list: ...
def do_bench_call(fn): ...  # plus whatever else the caller passes to triton.testing.do_bench
def host_compiler_call() -> str | None: ...
def launch_config_call(kernel: str, *, device, **problem) -> dict | None: ...
def attention_forward_call(q, k, v, o, lse, causal: bool, scale: float, *, bounds) -> bool: ...
def attention_backward_call(q, k, v, do, dk, dv, lse, causal: bool, scale: float, *, bounds) -> Callable | None: ...
def moe_experts_gemm_call(b, c, block_expert, *, gate_up: bool, gu) -> Callable | None: ...
def moe_weight_grad_call(
    lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m: int, *, gather_l: bool, gather_r: bool, top_k: int
) -> bool: ...
def value_call(): ...  # a VALUE / PREDICATE hook given as a function computes its value on first use


def signature_mismatch(fn, call) -> str | None:
    """None when ``fn`` can be called as the signature ``call`` declares, else what is missing."""
    try:
        have = inspect.signature(fn)
    except (TypeError, ValueError):  # a C callable without a signature: cannot tell
        return None
    want = list(inspect.signature(call).parameters.values())
    positional = [p.name for p in want if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    keywords = [p.name for p in want if p.kind is p.KEYWORD_ONLY]
    try:
        have.bind(*positional, **dict.fromkeys(keywords))
    except TypeError as e:
        called = ", ".join(positional + [f"{k}=" for k in keywords])
        return f"a function callable as ({called}): {e}"
    kinds = {p.kind for p in have.parameters.values()}
    if any(p.kind is p.VAR_KEYWORD for p in want) and inspect.Parameter.VAR_KEYWORD not in kinds:
        return f"a function taking ({', '.join(positional)}, **problem): it gets keyword arguments"
    return None


@dataclass(frozen=True)
class Hook:
    name: str
    kind: Kind
    point: str  # the install point in stock Triton that consults it (see install.py)
    default: str  # what mainline does when no backend specializes it
    doc: str
    signature: Callable | None = None  # FUNCTION: the call the point makes, as an annotated signature
    check: Check | None = None  # VALUE / PREDICATE: the value; FUNCTION: its result
    interpreter_only: str = ""  # why compiled kernels cannot honour it (they then fail at trace time)

    def value_error(self, backend: str, x) -> SpecContractError | None:
        """The error for a value (or result) outside the contract, naming backend and hook; else None."""
        problem = self.check(x) if self.check is not None else None
        if problem is None:
            return None
        what = "returned" if self.kind is Kind.FUNCTION else "is"
        return SpecContractError(f"backend {backend!r} hook {self.name!r} {what} the wrong thing: expected {problem}")

    def spec_error(self, backend: str, x) -> SpecContractError | None:
        """The error for a spec object that cannot stand for this hook at all, else None."""
        if self.kind is Kind.FUNCTION:
            if not callable(x):
                return SpecContractError(f"backend {backend!r} hook {self.name!r} must be a function, got {_got(x)}")
            problem = signature_mismatch(x, self.signature) if self.signature is not None else None
        elif callable(x) and not isinstance(x, types.ModuleType):
            problem = signature_mismatch(x, value_call)
            if problem is None:
                return None  # a value computed on first use: checked when it is called
        else:
            return self.value_error(backend, x)
        if problem is None:
            return None
        return SpecContractError(f"backend {backend!r} hook {self.name!r}: expected {problem}")


def _table(*hooks: Hook) -> dict[str, Hook]:
    table = {}
    for h in hooks:
        if h.name in table:
            raise SpecError(f"hook {h.name!r} declared twice")
        table[h.name] = h
    return table


F, V, P = Kind.FUNCTION, Kind.VALUE, Kind.PREDICATE
_BOOL = _is(bool)

HOOKS: dict[str, Hook] = _table(
    # -- language semantics (TritonSemantic methods; compiled and interpreted kernels alike) --
    Hook(
        "atomic_add_int64",
        F,
        "semantic.atomic_add",
        "one 64-bit atomic_rmw",
        "(semantic, ptr, val, mask, sem, scope) -> tensor: lower an int64/uint64 atomic add",
        signature=atomic_add_int64_call,
    ),
    Hook(
        "atomic_disable_bf16",
        P,
        "semantic.atom_red_typechecking_impl",
        "bf16 atomic add allowed",
        "True when the backend has no bf16 atomics: a bf16 atomic op raises a clear error",
        check=_BOOL,
    ),
    Hook(
        "arange_disable_check_power_of_two",
        P,
        "semantic.arange",
        "range must be a power of two",
        "True lifts the power-of-two rule on tl.arange's length",
        check=_BOOL,
        interpreter_only="stock Triton's IR verifier requires tt.make_range lengths to be powers of two, "
        "so a compiled kernel cannot use a lifted range until a compiler pass provides one",
    ),
    Hook(
        "ext_str_to_load_cache_modifier",
        F,
        "semantic.load_cache_modifier",
        "'.ca', '.cg', '.cv'",
        "(cache_modifier: str) -> ir.CACHE_MODIFIER | None: accept extra load cache modifiers",
        signature=cache_modifier_call,
        check=_cache_modifier,
    ),
    # -- compiler pipeline (knobs.runtime.add_stages_inspection_hook) --
    Hook(
        "pipeline_stages",
        F,
        "compiler.add_stages",
        "stock stages",
        "(backend, stages, options, language, capability) -> None: add or replace compile stages",
        signature=pipeline_stages_call,
        check=_none,
    ),
    Hook(
        "num_stages_cap",
        V,
        "compiler.parse_options",
        "no cap",
        "int >= 1: the most software-pipelining stages the backend supports; larger requests are clamped",
        check=_int_at_least(1),
    ),
    # -- runtime --
    Hook(
        "get_pruned_configs",
        F,
        "autotuner.prune_configs",
        "all configs",
        "(configs: list[Config], named_args: dict) -> list[Config]: drop configs the backend cannot run",
        signature=prune_configs_call,
        check=_is(list, tuple),
    ),
    Hook(
        "do_bench",
        F,
        "testing.do_bench",
        "triton.testing.do_bench",
        "(fn, warmup, rep, ...) -> float | list: the backend's timing routine",
        signature=do_bench_call,
        check=_timings,
    ),
    Hook(
        "get_cc",
        F,
        "runtime.build",
        "$CC, then clang, then gcc",
        "() -> str | None: the host C compiler for launcher stubs",
        signature=host_compiler_call,
        check=_is(str, none=True),
    ),
    # -- interpreter (TRITON_INTERPRET=1) --
    Hook(
        "interpreter_libdevice",
        V,
        "interpreter.libdevice",
        "extern calls raise NotImplementedError",
        "module: numpy-backed libdevice functions for interpreted kernels (or a function returning it, "
        "so the module loads only when a kernel is interpreted)",
        check=_is(types.ModuleType),
        interpreter_only="compiled kernels call the target's own libdevice",
    ),
    # -- tritonspec kernels (ops ask the backend for launch parameters) --
    Hook(
        "kernel_config",
        F,
        "tritonspec.launch_config",
        "the kernel's own heuristic",
        "(kernel: str, *, device, **problem) -> dict | None: the launch parameters (tile sizes, num_warps, "
        "num_stages, flags) to override for a tritonspec kernel on that torch device; checked against the "
        "kernel's LaunchConfig type (tritonspec.launch.ConfigTable writes it as a table by kernel)",
        signature=launch_config_call,
        check=_is(dict, none=True),
    ),
    Hook(
        "attention_forward",
        F,
        "tritonspec.ops.attention",
        "the portable Triton forward kernel",
        "(q, k, v, o, lse, causal: bool, scale: float, *, bounds) -> bool: run the backend's own forward kernel, "
        "writing o and lse (base-2 logsumexp of the scaled scores per row, padded rows already +inf); bounds is "
        "None or each query's key interval, int32 (2, batch, padded rows: empty intervals), and a query that sees "
        "no key gets o = 0 and lse = +inf; False keeps the portable kernel",
        signature=attention_forward_call,
        check=_BOOL,
    ),
    Hook(
        "attention_backward",
        F,
        "tritonspec.ops.attention",
        "the portable Triton backward kernels",
        "(q, k, v, do, dk, dv, lse, causal: bool, scale: float, *, bounds) -> run | False | None: take the problem by "
        "returning run(dqa, delta), which runs the backend's own backward: it adds dQ into dqa (zeroed fp32 "
        "(batch, heads_q, seq_q, head dim padded to a power of two); the op converts it) and writes dk and dv, "
        "from lse and delta = rowsum(dO * O) per q row (padded rows +inf and 0), under bounds as the forward's. "
        "Two phases, so that the op allocates and zeroes dqa only for a kernel that uses it; False or None keeps "
        "the portable kernels",
        signature=attention_backward_call,
        check=_runner_or_decline,
    ),
    Hook(
        "moe_experts_gemm",
        F,
        "tritonspec.ops.moe",
        "the portable Triton GEMMs of the experts",
        "(b, c, block_expert, *, gate_up: bool, gu) -> run | None: take one of the experts' grouped GEMMs by "
        "returning run(a), which computes c = a_rows @ b_e for each row block of the sort (block_expert: int32, "
        "each block's expert, -1 past the last expert's rows: zeros); a is the (R, K) sorted rows (padding rows "
        "zeros), b the experts' weights (E, K, N) by strides. gate_up: b's columns are [gate | up] (E, K, 2N), c "
        "gets h = silu(gate) * up (each rounded to c's dtype first, as Hugging Face's experts) and gu, when not "
        "None, the (R, 2N) gate and up. Two phases, so that the op gathers the rows only for a kernel that takes "
        "them; None or False keeps the portable kernels",
        signature=moe_experts_gemm_call,
        check=_runner_or_decline,
    ),
    Hook(
        "moe_weight_grad",
        F,
        "tritonspec.ops.moe",
        "the portable Triton weight-gradient kernel of the experts",
        "(lhs, rhs, dw, row_pair, expert_start, expert_rows, block_m: int, *, gather_l: bool, gather_r: bool, "
        "top_k: int) -> bool: write each expert's weight gradient dw[e] (E, M, N) = the sum over its rows of the "
        "sort (expert_start[e], expert_rows[e] of them, padded to block_m) of lhs_row^T rhs_row. An operand is "
        "either the sorted rows themselves ((R, M) or (R, N), zeros in padding rows) or, gather_*, the tokens' "
        "rows (T, ...), row r's token being row_pair[r] // top_k (-1: a padding row, zeros); no bias gradient. "
        "False keeps the portable kernel",
        signature=moe_weight_grad_call,
        check=_BOOL,
    ),
)

# FlagTree's injector lists: each names functions the spec module also defines.
#   *_ext_spec_func_list: new names; colliding with a mainline name is an error.
#   *_ext_base_func_list: replacements of existing mainline names (explicitly allowed).
INJECTOR_LISTS: dict[str, tuple[str, ...]] = {
    "core": ("core_ext_spec_func_list", "core_ext_base_func_list"),
    "semantic": ("semantic_ext_spec_func_list", "semantic_ext_base_func_list"),
    "standard": ("standard_ext_spec_func_list", "standard_ext_base_func_list"),
    "math": ("math_ext_spec_func_list", "math_ext_base_func_list"),
}
LIST_NAMES = frozenset(n for pair in INJECTOR_LISTS.values() for n in pair)
SEMANTIC_PREFIX = "ext_semantic_"


def suggest(name: str, candidates) -> str:
    import difflib  # only on an error path

    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def get_hook(name: str) -> Hook:
    """The declared hook ``name``; an undeclared name raises with the nearest declared ones."""
    try:
        return HOOKS[name]
    except KeyError:
        raise SpecError(f"{name!r} is not a declared tritonspec hook{suggest(name, HOOKS)}") from None


# What a spec module says about its backend (a ``tritonspec.BackendInfo``); not a hook.
BACKEND_INFO = "backend_info"


def spec_module_exports(module) -> list[str]:
    """Names a spec module exports: ``__all__`` when present, else its public non-module attributes."""
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]
    return list(names)


def injected(module) -> dict[str, object]:
    """``attribute -> object`` for every function the module's injector lists name (exported or not)."""
    found = {}
    for group, lists in INJECTOR_LISTS.items():
        for list_name in lists:
            for fn_name in getattr(module, list_name, None) or ():
                attr = SEMANTIC_PREFIX + fn_name if group == "semantic" else fn_name
                found[attr] = getattr(module, attr, None)
    return found


def validate_spec_module(backend: str, module) -> None:
    """Every export must be a declared hook honouring its contract, an injector list of names, or a
    function an injector list names."""
    for group, lists in INJECTOR_LISTS.items():
        for list_name in lists:
            names = getattr(module, list_name, None)
            if names is None:
                continue
            if not isinstance(names, (list, tuple)) or not all(isinstance(n, str) and n for n in names):
                raise SpecError(
                    f"backend {backend!r}: {module.__name__}.{list_name} must be a list of names, got {_got(names)}"
                )
            for fn_name in names:
                attr = SEMANTIC_PREFIX + fn_name if group == "semantic" else fn_name
                if not hasattr(module, attr):
                    raise SpecError(
                        f"backend {backend!r}: {list_name} names {fn_name!r} but the spec module "
                        f"{module.__name__} defines no {attr!r}"
                    )
                if not callable(getattr(module, attr)):
                    raise SpecError(
                        f"backend {backend!r}: {list_name} names {fn_name!r} but "
                        f"{module.__name__}.{attr} is not a function"
                    )
    listed = set(injected(module))
    for name in spec_module_exports(module):
        if not hasattr(module, name):
            raise SpecError(f"backend {backend!r}: {module.__name__}.__all__ names {name!r}, which it does not define")
        if name in HOOKS:
            error = HOOKS[name].spec_error(backend, getattr(module, name))
            if error is not None:
                raise error
        elif name not in LIST_NAMES and name not in listed and name != BACKEND_INFO:
            raise SpecError(
                f"backend {backend!r}: spec module {module.__name__} exports {name!r}, which is not a "
                f"declared hook{suggest(name, list(HOOKS) + sorted(LIST_NAMES))}"
            )
