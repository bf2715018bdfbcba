"""The declared hook table: every name a backend may specialize, declared once.

Mainline call sites and spec modules both go through this table, so a typo is an error
with a suggestion instead of a silent fallback to the default (FlagTree's weak spot), and
upgrading Triton means re-validating this one file against the new release.
"""
from __future__ import annotations

import difflib
import enum
from dataclasses import dataclass


class Kind(enum.Enum):
    VALUE = "value"  # the spec returns a value (or is a constant); None means "use the default"
    PREDICATE = "predicate"  # the spec returns True to specialize; the default is False
    FUNCTION = "function"  # the spec is a replacement function, fetched with spec_func()


@dataclass(frozen=True)
class Hook:
    name: str
    kind: Kind
    point: str  # the install point in stock Triton that consults it (see install.py)
    default: str  # what mainline does when no backend specializes it
    doc: str


class SpecError(LookupError):
    """A hook or spec module that does not match the declared table."""


def _table(*hooks: Hook) -> dict[str, Hook]:
    table = {}
    for h in hooks:
        if h.name in table:
            raise SpecError(f"hook {h.name!r} declared twice")
        table[h.name] = h
    return table


F, V, P = Kind.FUNCTION, Kind.VALUE, Kind.PREDICATE

HOOKS: dict[str, Hook] = _table(
    # -- language semantics (TritonSemantic methods; compiled and interpreted kernels alike) --
    Hook("atomic_add_int64", F, "semantic.atomic_add", "one 64-bit atomic_rmw",
         "(semantic, ptr, val, mask, sem, scope) -> tensor: lower an int64/uint64 atomic add"),
    Hook("atomic_disable_bf16", P, "semantic.atom_red_typechecking_impl", "bf16 atomic add allowed",
         "True when the backend has no bf16 atomics: a bf16 atomic op raises a clear error"),
    Hook("arange_disable_check_power_of_two", P, "semantic.arange", "range must be a power of two",
         "True lifts the power-of-two rule on tl.arange's length"),
    Hook("ext_str_to_load_cache_modifier", F, "semantic.load_cache_modifier", "'.ca', '.cg', '.cv'",
         "(cache_modifier: str) -> ir.CACHE_MODIFIER | None: accept extra load cache modifiers"),
    # -- compiler pipeline (knobs.runtime.add_stages_inspection_hook) --
    Hook("pipeline_stages", F, "compiler.add_stages", "stock stages",
         "(backend, stages, options, language, capability) -> None: add or replace compile stages"),
    Hook("num_stages_cap", V, "compiler.parse_options", "no cap",
         "int: the most software-pipelining stages the backend supports; larger requests are clamped"),
    # -- runtime --
    Hook("get_pruned_configs", F, "autotuner.prune_configs", "all configs",
         "(configs: list[Config], named_args: dict) -> list[Config]: drop configs the backend cannot run"),
    Hook("do_bench", F, "testing.do_bench", "triton.testing.do_bench",
         "(fn, warmup, rep, ...) -> float | list: the backend's timing routine"),
    Hook("get_cc", F, "runtime.build", "$CC, then clang, then gcc",
         "() -> str | None: the host C compiler for launcher stubs"),
    # -- interpreter (TRITON_INTERPRET=1) --
    Hook("interpreter_libdevice", V, "interpreter.libdevice", "extern calls raise NotImplementedError",
         "module: numpy-backed libdevice functions for interpreted kernels"),
    # -- tritonspec kernels (ops ask the backend for launch parameters) --
    Hook("kernel_config", F, "tritonspec.launch_config", "the kernel's own heuristic",
         "(kernel: str, **problem) -> dict | None: block sizes, num_warps, num_stages for a tritonspec kernel"),
    Hook("attention_config", F, "tritonspec.launch_config", "the kernel's own heuristic",
         "(kernel: str, **problem) -> dict | None: attention tile sizes, warps, stages, TMA / warp-spec flags"),
    Hook("attention_forward", F, "tritonspec.ops.attention", "the portable Triton forward kernel",
         "(q, k, v, o, lse, causal: bool, scale: float) -> bool: run the backend's own forward kernel, writing o "
         "and lse (base-2 logsumexp of the scaled scores per row, padded rows already +inf); False keeps the "
         "portable kernel"),
    Hook("attention_backward", F, "tritonspec.ops.attention", "the portable Triton backward kernels",
         "(q, k, v, do, dqa, dk, dv, lse, delta, causal: bool, scale: float) -> bool: run the backend's own "
         "backward, adding dQ into dqa (zeroed fp32, head dim padded to a power of two; the op converts it) "
         "and writing dk and dv (lse and delta = rowsum(dO * O) per q row, padded rows +inf and 0); False "
         "keeps the portable kernels"),
)

# The injector lists of seed 001 §4.3/4.4: each names functions the spec module also exports.
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
    close = difflib.get_close_matches(name, list(candidates), n=3, cutoff=0.6)
    return f"; did you mean {', '.join(repr(c) for c in close)}?" if close else ""


def get_hook(name: str) -> Hook:
    """The declared hook ``name``; an undeclared name raises with the nearest declared ones."""
    try:
        return HOOKS[name]
    except KeyError:
        raise SpecError(f"{name!r} is not a declared tritonspec hook{suggest(name, HOOKS)}") from None


def spec_module_exports(module) -> list[str]:
    """Names a spec module exports: ``__all__`` when present, else its public non-module attributes."""
    names = getattr(module, "__all__", None)
    if names is None:
        import types
        names = [n for n, v in vars(module).items() if not n.startswith("_") and not isinstance(v, types.ModuleType)]
    return list(names)


def validate_spec_module(backend: str, module) -> None:
    """Every export must be a declared hook, an injector list, or a function an injector list names."""
    exports = spec_module_exports(module)
    listed = set()
    for group, lists in INJECTOR_LISTS.items():
        for list_name in lists:
            for fn_name in getattr(module, list_name, ()) or ():
                attr = SEMANTIC_PREFIX + fn_name if group == "semantic" else fn_name
                if not hasattr(module, attr):
                    raise SpecError(f"backend {backend!r}: {list_name} names {fn_name!r} but the spec module "
                                    f"{module.__name__} defines no {attr!r}")
                listed.add(attr)
    for name in exports:
        if not hasattr(module, name):
            raise SpecError(f"backend {backend!r}: {module.__name__}.__all__ names {name!r}, which it does not define")
        if name in HOOKS or name in LIST_NAMES or name in listed:
            continue
        raise SpecError(f"backend {backend!r}: spec module {module.__name__} exports {name!r}, which is not a "
                        f"declared hook{suggest(name, list(HOOKS) + sorted(LIST_NAMES))}")
