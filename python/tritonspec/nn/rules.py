"""YAML injection rules (KTransformers' format) on the shared engine.

A rule file is a list of::

    - match:                      # at least one of name/class/kernel; all given must hold
        name: "^model\\.layers\\.\\d+\\.mlp$"      # regex.search on the dotted module path
        class: transformers.models.llama.modeling_llama.LlamaMLP   # isinstance, by dotted name
        kernel: swiglu            # a module the kernel table's kernel recognizes (tag, class, detector)
      replace:
        class: tritonspec.nn.hub.layers.SwiGLUMLP  # or "default": keep the module as it is
        kernel: swiglu            # instead of class: that kernel's hub layer, from the kernel table
        kwargs: {}                # for module classes: passed to the constructor
      recursive: true             # false: do not look at this module's children
      optional: false             # true: matching nothing is not an error

The walk is pre-order; for each module the first matching rule wins. Why the import restrictions: a
rule file is data, and must never be a way to run arbitrary code. ``match.class`` is compared by name
against the module's class hierarchy and imports nothing; ``replace.class`` is imported only from
modules under an allowed prefix (``tritonspec`` plus what the caller passes).

A rule file is also bounded, so a hostile or broken one fails with :class:`RuleError` instead of hanging,
crashing or taking gigabytes, whether the rules come as YAML or as Python lists and dicts:

- ``match.name`` is a pattern in Python's ``re`` syntax, at most ``MAX_PATTERN_CHARS`` long; the file's patterns
  together may expand to at most ``MAX_REGEX_UNITS`` when compiled (counted repetitions multiply), and are searched
  with the ``regex`` package under a timeout of ``MATCH_TIMEOUT_S`` per module path and ``MATCH_BUDGET_S`` for all
  searches of one :func:`apply_rules` call;
- lists/mappings nest at most ``MAX_NESTING_DEPTH`` levels, the rule list itself counting as one (a rule's
  ``replace.kwargs`` is at level 4); values shared through YAML aliases are walked once, not once per path, and
  error messages show values cut to a few items and characters (reprlib's bounds), so a billion-laughs file costs
  what its text does;
- ``replace.kwargs`` must be parameters of the replacement's builder, and are checked by it (the values, like an
  RMSNorm's ``eps``) when the rule is applied, not at the first forward.

A replacement class is either a hub-style pure layer (validated like kernelize's; its ``forward`` is
bound onto the matched module, or for MoE experts that transformers dispatches, selected through its
``experts_implementation`` switch where that says the same: :mod:`tritonspec.nn.experts`) or an ``nn.Module``
to put in the module's place. For the latter the class (or a converter registered with
:func:`register_module_converter`) builds it from the original module, sharing its parameters, so training
updates survive ``revert``. A replacement with a ``release()`` method has it called when it is taken out again
(revert, or a failed rule file), to hand back what it took from the original (offloaded experts return the
weights to their device).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
import math
import re
import reprlib
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import regex
from torch import nn

from .. import kernel_table
from ..specialization.hooks import suggest
from . import engine, experts
from .repository import validate_layer
from .detectors import infer_layer_name, tagged_name

try:  # re's parser, to read a pattern's structure before the regex package compiles (and expands) it
    from re import _parser as _re_parser  # Python 3.11+
except ImportError:  # Python 3.10
    import sre_parse as _re_parser

logger = logging.getLogger("tritonspec.nn.rules")

DEFAULT_ALLOWED_MODULES = ("tritonspec",)
_RULE_KEYS = {"match", "replace", "recursive", "optional"}
_MATCH_KEYS = {"name", "class", "kernel"}
_REPLACE_KEYS = {"class", "kernel", "kwargs"}
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Seconds one match.name search of one module path may take. Legitimate patterns against dotted module paths
# take microseconds, so this is thousands of times the need; only catastrophic backtracking gets near it, and
# then an error naming the rule beats hanging forever (re has no timeout; the regex package has).
MATCH_TIMEOUT_S = 0.1
# Seconds all match.name searches of one apply_rules call may take together: without it, 60 rules each staying
# just under the per-search timeout keep a 2-layer model busy for minutes. A search costs about 6 us here (5 of
# them the timeout's bookkeeping), so this is half a million searches: 50,000 module paths against 10 rules.
MATCH_BUDGET_S = 3.0
# Characters in one match.name pattern: a dotted module path is well under 100, an alternation of dozens of them
# fits; the bound keeps scanning and parsing (before the size below is known) to milliseconds.
MAX_PATTERN_CHARS = 2000
# Units all match.name patterns of one rule file may expand to when compiled: each atom counts once per
# repetition of every counted quantifier around it (``a{1000}`` is 1000, ``(a{1000}){1000}`` a million), the
# upper count where there is one, else the lower. The regex package expands counts when compiling: 2-8 us and
# 250-1000 bytes per unit (``a{10000000}``: 17 s, 2.6 GB; ``((a|bc){1000}){1000}`` crashes it), so this bound is
# about 0.2 s and 50 MB at worst. Real patterns take tens to a hundred (``\d{1,3}`` 3, a 48-layer alternation
# 115), so a file of dozens fits; it bounds every repetition count too.
MAX_REGEX_UNITS = 50_000
# Lists/mappings a rule file may nest, the rule list counting as 1 (a rule is 2, its replace.kwargs 4). Real files
# need about 6; PyYAML composes nodes recursively, so a bound far below Python's recursion limit turns a deep
# file into a RuleError instead of a RecursionError.
MAX_NESTING_DEPTH = 32
# Group nesting a match.name regex may have: the regex compiler recurses per level, so how deep it gets
# before a RecursionError depends on the caller's stack and recursion limit (torch.compile raises it);
# a fixed bound gives the same answer everywhere.
MAX_GROUP_DEPTH = 64
_NESTED = (list, tuple, dict)
_REPEATS = {
    getattr(_re_parser, op) for op in ("MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT") if hasattr(_re_parser, op)
}


class RuleError(ValueError):
    """A rule file problem; the message names the rule index and the offending key."""

    def __init__(self, index: int | None, key: str, message: str):
        where = f"rule {index}: " if index is not None else ""
        super().__init__(f"{where}{key}: {message}")
        self.index, self.key = index, key


class _BoundedRepr(reprlib.Repr):
    """reprlib's bounds for values from a rule file: a few levels, items and characters, so the message about a
    billion-laughs value is as short as any other. Only plain data is shown; other objects show their type name,
    so no ``__repr__`` of theirs runs (a list subclass's could walk every path)."""

    def __init__(self):
        super().__init__()
        self.maxlevel, self.maxstring, self.maxother = 3, 80, 40
        self.maxlist = self.maxtuple = self.maxdict = self.maxset = self.maxfrozenset = 4

    def repr_int(self, x, level):
        return repr(x) if x.bit_length() <= 64 else f"<int of {x.bit_length()} bits>"  # repr refuses > 4300 digits

    def repr_float(self, x, level):
        return repr(x)

    repr_bool = repr_NoneType = repr_float

    def repr_instance(self, x, level):
        return f"<{type(x).__name__}>"


shown = _BoundedRepr().repr  # for every message that quotes a value from a rule file (kwargs too)


def _named(value) -> str:
    """A mapping key or kwarg name for a message or a RuleError key: itself when it is a short string."""
    return value if isinstance(value, str) and len(value) <= 60 else shown(value)


@dataclass(repr=False)
class Rule:
    index: int
    name: regex.Pattern | None
    match_class: str | None
    replace_class: str | None  # None means "default"
    kwargs: dict = field(default_factory=dict)
    recursive: bool = True
    optional: bool = False
    match_kernel: str | None = None
    replace_kernel: str | None = None  # the kernel table's layer instead of replace_class

    def __repr__(self) -> str:
        fields = (f"{k}={shown(v.pattern if isinstance(v, regex.Pattern) else v)}" for k, v in vars(self).items())
        return f"Rule({', '.join(fields)})"

    def matches(self, path: str, module: nn.Module, timeout: float = MATCH_TIMEOUT_S) -> bool:
        """Whether the rule holds for ``module`` at ``path``; ``timeout`` (at most MATCH_TIMEOUT_S) is what is left
        of the rule file's matching budget."""
        if self.name is not None:
            try:
                found = self.name.search(path, timeout=max(timeout, 0))  # regex: a negative timeout is none at all
            except TimeoutError:
                why = (
                    f"timed out after {MATCH_TIMEOUT_S}s on {shown(path)} (catastrophic backtracking"
                    if timeout >= MATCH_TIMEOUT_S
                    else f"ran out of time on {shown(path)}: all match.name "
                    f"searches of one apply_rules call may take {MATCH_BUDGET_S}s together (slow patterns"
                )
                raise RuleError(
                    self.index, "match.name", f"{shown(self.name.pattern)} {why}; simplify the pattern)"
                ) from None
            if not found:
                return False
        if self.match_class is not None and self.match_class not in _class_names(type(module)):
            return False
        if self.match_kernel is not None and not _recognizes(kernel_table.get(self.match_kernel), module):
            return False
        return True


def _recognizes(kernel: kernel_table.Kernel, module: nn.Module) -> bool:
    """The kernel's layer would replace this module: tagged with its name, or recognized untagged."""
    if kernel.site != "module" or kernel.layer is None:
        return False
    name = tagged_name(module)
    return name in kernel.layer.names if name is not None else infer_layer_name(module) == kernel.layer.name


def _class_names(cls) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}


def _allowed(dotted: str, allowed: Iterable[str]) -> bool:
    return any(dotted == p or dotted.startswith(p.rstrip(".") + ".") for p in allowed)


def _too_deep(index: int | None, labels: list, cyclic: bool = False) -> RuleError:
    """The error for nesting past MAX_NESTING_DEPTH; the key is the path of up to three mapping keys (like
    ``replace.kwargs.x``) down to the too-deep value, not the whole (possibly hundreds of levels long) path."""
    keys = []
    for label in labels[:3]:
        if not isinstance(label, str):
            break
        keys.append(_named(label))
    key = ".".join(keys) or ("rule" if index is not None else "rules")
    return RuleError(
        index,
        key,
        f"nested deeper than {MAX_NESTING_DEPTH} levels of lists/mappings"
        f"{' (it contains itself)' if cyclic else ''}; that is the maximum nesting depth of a rule file",
    )


def _children(obj) -> list:
    items = list(obj.keys()) + list(obj.values()) if isinstance(obj, dict) else obj
    return [c for c in items if isinstance(c, _NESTED)]


def _height(root: Any, memo: dict[int, float]) -> float:
    """Levels of lists/tuples/dicts in ``root`` (0 for a scalar, inf for a cycle). Iterative, so any depth is
    safe; ``memo`` (by id) makes an object shared through many YAML aliases cost once, not once per path."""
    if not isinstance(root, _NESTED):
        return 0
    stack, on_path = [(root, iter(_children(root)))], {id(root)}
    while stack:
        obj, todo = stack[-1]
        for child in todo:
            if id(child) in on_path:
                return math.inf
            if id(child) not in memo:
                stack.append((child, iter(_children(child))))
                on_path.add(id(child))
                break
        else:
            stack.pop()
            on_path.discard(id(obj))
            memo[id(obj)] = 1 + max((memo[id(c)] for c in _children(obj)), default=0)
    return memo[id(root)]


def _group_depth(pattern: str) -> int:
    """The deepest group nesting of a regex (escapes and character classes skipped)."""
    depth = deepest = 0
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i += 1
        elif c == "[":
            i += 1
            i += pattern[i : i + 1] == "^"
            i += pattern[i : i + 1] == "]"  # a leading ']' is literal
            while i < n and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
        elif c == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif c == ")":
            depth -= 1
        i += 1
    return deepest


def _check_nesting(i: int, raw: Any) -> None:
    """Rules given as Python objects get the same bound as YAML (whose loader checks while composing), before
    anything recurses into them (a repr in an error message, a constructor taking the kwargs)."""
    memo: dict[int, float] = {}
    level = 2  # of the rule; the rule list is level 1
    if level + _height(raw, memo) - 1 <= MAX_NESTING_DEPTH:
        return
    labels, obj = [], raw
    while isinstance(obj, dict) and len(labels) < 3:  # name the key whose value nests too deep
        hit = next(((k, v) for k, v in obj.items() if level + _height(v, memo) > MAX_NESTING_DEPTH), None)
        if hit is None or isinstance(hit[0], tuple):
            break
        labels.append(str(hit[0]))
        obj, level = hit[1], level + 1
    raise _too_deep(i, labels, cyclic=_height(raw, memo) == math.inf)


@functools.cache
def _bounded_loader() -> type:
    """A yaml.SafeLoader that stops at MAX_NESTING_DEPTH while composing: PyYAML composes nodes recursively, so a
    deep enough file would otherwise end in a bare RecursionError. Built on first use: importing tritonspec.nn
    does not import yaml."""
    import yaml

    class BoundedSafeLoader(yaml.SafeLoader):
        def __init__(self, stream):
            super().__init__(stream)
            self.labels: list = []  # path to the node being composed: sequence index, mapping key, None (a key)
            self.depth = 0
            self.root_is_list = False

        def compose_node(self, parent, index):
            nested = self.check_event(yaml.SequenceStartEvent, yaml.MappingStartEvent)  # not a scalar or alias
            if parent is None:
                self.root_is_list = self.check_event(yaml.SequenceStartEvent)
            else:
                self.labels.append(
                    index
                    if isinstance(parent, yaml.SequenceNode)
                    else index.value
                    if isinstance(index, yaml.ScalarNode)
                    else None
                )
            self.depth += int(nested)
            try:
                if self.depth > MAX_NESTING_DEPTH:
                    raise _too_deep(self.labels[0], self.labels[1:]) if self.root_is_list else _too_deep(None, [])
                return super().compose_node(parent, index)
            finally:
                self.depth -= int(nested)
                if parent is not None:
                    self.labels.pop()

    return BoundedSafeLoader


def _regex_units(parsed) -> int:
    """What a pattern parsed by ``re``'s parser expands to when compiled (MAX_REGEX_UNITS says how it counts).
    Groups, alternatives and lookarounds are found as the parsed subpatterns inside an item's arguments, whatever
    the opcode, so an opcode a later Python adds is still counted."""
    units = 0
    for op, av in parsed:
        if op in _REPEATS:
            low, high, sub = av
            units += max(low if high == _re_parser.MAXREPEAT else high, 1) * _regex_units(sub)
            continue
        inner = 0
        for arg in av if isinstance(av, (tuple, list)) else (av,):
            for sub in arg if isinstance(arg, list) else (arg,):  # BRANCH holds a list of alternatives
                if isinstance(sub, _re_parser.SubPattern):
                    inner += _regex_units(sub)
        units += max(inner, 1)
    return units


def _name_compiler() -> Callable[[int, Any], regex.Pattern]:
    """Compiles the match.name patterns of one rule file, bounded before anything is compiled: length, group
    depth, and what they expand to together (``re``'s parser gives their structure without expanding it)."""
    units_left = MAX_REGEX_UNITS

    def compile_name(i: int, pattern) -> regex.Pattern:
        nonlocal units_left
        if not isinstance(pattern, str):
            raise RuleError(i, "match.name", f"expected a regex string, got {type(pattern).__name__}")
        if len(pattern) > MAX_PATTERN_CHARS:
            raise RuleError(
                i,
                "match.name",
                f"{len(pattern)} characters, over the {MAX_PATTERN_CHARS} a pattern may have: {shown(pattern)}",
            )
        too_deep = RuleError(i, "match.name", f"regex nests its groups too deeply to compile: {shown(pattern)}")
        if _group_depth(pattern) > MAX_GROUP_DEPTH:
            raise too_deep
        try:
            units = _regex_units(_re_parser.parse(pattern))
        except re.error as e:
            raise RuleError(i, "match.name", f"invalid regex {shown(pattern)} (Python re syntax): {e}") from None
        except RecursionError:  # the parser recurses per group level
            raise too_deep from None
        if units > units_left:
            spent = MAX_REGEX_UNITS - units_left
            raise RuleError(
                i,
                "match.name",
                f"{shown(pattern)} expands to "
                f"{units if units <= MAX_REGEX_UNITS else f'over {MAX_REGEX_UNITS}'} units when compiled"
                f"{f', the earlier patterns to {spent}' if spent else ''}; a rule file's patterns may "
                f"expand to {MAX_REGEX_UNITS} together (a repetition count multiplies what it repeats)",
            )
        units_left -= units
        try:
            return regex.compile(pattern, regex.V0)  # V0: the re-compatible syntax checked above
        except regex.error as e:
            raise RuleError(i, "match.name", f"invalid regex {shown(pattern)}: {e}") from None
        except RecursionError:  # the compiler recurses per group level
            raise too_deep from None

    return compile_name


def _check_keys(i: int, prefix: str, mapping: dict, allowed: set[str]) -> None:
    """The first key that is not ``allowed`` (not a string, else in sorted order) is an error naming it."""
    odd = next((k for k in mapping if not isinstance(k, str)), None)
    unknown = sorted(k for k in mapping if isinstance(k, str) and k not in allowed)
    if odd is not None or unknown:
        raise RuleError(
            i,
            prefix + _named(unknown[0] if odd is None else odd),
            f"unknown key (allowed: {', '.join(sorted(allowed))})",
        )


def _parse_rule(i: int, raw: Any, compile_name: Callable[[int, Any], regex.Pattern]) -> Rule:
    _check_nesting(i, raw)
    if not isinstance(raw, dict):
        raise RuleError(i, "rule", f"expected a mapping with match/replace, got {type(raw).__name__}")
    _check_keys(i, "", raw, _RULE_KEYS)
    match = raw.get("match")
    if not isinstance(match, dict):
        raise RuleError(i, "match", "required, a mapping with name and/or class")
    _check_keys(i, "match.", match, _MATCH_KEYS)
    if not match.get("name") and not match.get("class") and not match.get("kernel"):
        raise RuleError(i, "match", "needs at least one of name, class, kernel")
    match_kernel = _kernel_name(i, "match.kernel", match.get("kernel"), site="module")
    pattern = compile_name(i, match["name"]) if "name" in match else None
    match_class = match.get("class")
    if match_class is not None and (not isinstance(match_class, str) or not _DOTTED.match(match_class)):
        raise RuleError(
            i, "match.class", f"expected a dotted class name like pkg.module.Class, got {shown(match_class)}"
        )
    replace = raw.get("replace")
    if not isinstance(replace, dict):
        raise RuleError(i, "replace", "required, a mapping with class and optional kwargs")
    _check_keys(i, "replace.", replace, _REPLACE_KEYS)
    if ("class" in replace) == ("kernel" in replace):
        raise RuleError(i, "replace", "needs exactly one of class, kernel")
    replace_kernel = _kernel_name(i, "replace.kernel", replace.get("kernel"))
    rclass = replace.get("class", "default" if replace_kernel is None else None)
    if replace_kernel is None and (not isinstance(rclass, str) or not (rclass == "default" or _DOTTED.match(rclass))):
        raise RuleError(i, "replace.class", f"expected 'default' or a dotted class name, got {shown(rclass)}")
    kwargs = replace.get("kwargs", {}) or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RuleError(i, "replace.kwargs", "expected a mapping of keyword arguments")
    flags = {}
    for key, default in (("recursive", True), ("optional", False)):
        v = raw.get(key, default)
        if not isinstance(v, bool):
            raise RuleError(i, key, f"expected true or false, got {shown(v)}")
        flags[key] = v
    return Rule(
        i,
        pattern,
        match_class,
        None if rclass == "default" else rclass,
        dict(kwargs),
        **flags,
        match_kernel=match_kernel,
        replace_kernel=replace_kernel,
    )


def _kernel_name(i: int, key: str, name, site: str | None = None) -> str | None:
    """``name`` checked against the kernel table (a layer that replaces modules where ``site`` says so)."""
    if name is None:
        return None
    if not isinstance(name, str) or name not in kernel_table.KERNELS:
        close = suggest(name, kernel_table.KERNELS) if isinstance(name, str) and len(name) <= 60 else ""
        raise RuleError(
            i, key, f"{shown(name)} is not a declared kernel{close}; declared: {', '.join(kernel_table.KERNELS)}"
        )
    kernel = kernel_table.KERNELS[name]
    if kernel.layer is None or (site is not None and kernel.site != site):
        raise RuleError(i, key, f"kernel {shown(name)} installs at a {kernel.site!r} site, not by replacing a module")
    return name


def load_rules(source: str | Path | list) -> list[Rule]:
    """Parse rules from a YAML file path, a YAML string, or an already-loaded list; validates everything."""
    is_path = isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))
    if isinstance(source, Path) or is_path:
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"source: rule file {path} does not exist")
        source = path.read_text()
    if isinstance(source, str):
        import yaml

        try:  # a SafeLoader: YAML tags cannot construct Python objects
            source = yaml.load(source, Loader=_bounded_loader())
        except yaml.YAMLError as e:
            raise RuleError(None, "yaml", str(e)) from None
    if not isinstance(source, list) or not source:
        raise RuleError(None, "rules", "a rule file is a non-empty list of rules")
    compile_name = _name_compiler()
    return [_parse_rule(i, r, compile_name) for i, r in enumerate(source)]


_CONVERTERS: dict[type, Callable[..., nn.Module]] = {}


def register_module_converter(cls: type, build: Callable[..., nn.Module]) -> None:
    """``build(original_module, **kwargs) -> instance of cls`` for classes without a ``from_module`` classmethod."""
    _CONVERTERS[cls] = build


def _import_class(rule: Rule, allowed: tuple[str, ...]) -> type:
    if rule.replace_kernel is not None:  # a declared kernel's layer: trusted code, whatever its module
        return kernel_table.get(rule.replace_kernel).layer.load()
    dotted = rule.replace_class
    if not _allowed(dotted, allowed):
        raise RuleError(
            rule.index,
            "replace.class",
            f"{dotted} is outside the allowed modules ({', '.join(allowed)}); pass allowed_modules=[...] to allow it",
        )
    mod_name, _, cls_name = dotted.rpartition(".")
    try:
        obj = getattr(importlib.import_module(mod_name), cls_name)
    except (ImportError, AttributeError) as e:
        raise RuleError(rule.index, "replace.class", f"cannot import {dotted}: {e}") from None
    if not (inspect.isclass(obj) and issubclass(obj, nn.Module)):
        raise RuleError(rule.index, "replace.class", f"{dotted} is not a torch.nn.Module subclass")
    return obj


def _is_pure_layer(cls: type) -> bool:
    return cls.__init__ is nn.Module.__init__


def _builder(rule: Rule, cls: type) -> Callable[..., nn.Module]:
    """``build(original, parent=..., path=...)``; a ``from_module`` that declares ``parent`` or ``path``
    receives them (a replacement that works with its siblings, like offloaded experts and their router)."""
    from_module = getattr(cls, "from_module", None)
    if callable(from_module):
        wants = set(inspect.signature(from_module).parameters) & {"parent", "path"}
        _check_kwargs(rule.kwargs, from_module)
        return lambda orig, **where: from_module(orig, **{k: where[k] for k in wants}, **rule.kwargs)
    build = _CONVERTERS.get(cls)
    if build is None:
        _load_builtin_converters()
        build = _CONVERTERS.get(cls)
    if build is None:
        raise RuleError(
            rule.index,
            "replace.class",
            f"{rule.replace_class} is neither a stateless layer nor has "
            "a from_module(original, **kwargs) classmethod or a registered converter",
        )
    _check_kwargs(rule.kwargs, build)
    return lambda orig, **where: build(orig, **rule.kwargs)


def _check_kwargs(kwargs: dict, build: Callable[..., nn.Module]) -> None:
    """Rule kwargs must be keyword parameters of ``build(original, ...)`` (a builder taking ``**kwargs`` checks its
    own); their values are checked by the builder and the constructor it calls."""
    params = list(inspect.signature(build).parameters.values())[1:]  # after the original module
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return
    takes = [
        p.name
        for p in params
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("parent", "path")
    ]
    unknown = sorted(set(kwargs) - set(takes))
    if unknown:
        name = _named(unknown[0])
        raise TypeError(
            f"unknown kwarg {name}{suggest(name, takes) if len(name) <= 60 else ''}; it takes "
            f"{', '.join(takes) or 'none'}"
        )


def _said(error: BaseException) -> str:
    """``str(error)``, bounded. Only when its arguments are strings: a KeyError's (or any exception's with other
    arguments) str is their repr, and the argument may be a rule file's value."""
    text = str(error) if all(isinstance(a, str) for a in error.args) else shown(error.args)
    return text if len(text) <= 500 else text[:500] + "..."


def _load_builtin_converters() -> None:
    try:
        from . import modules as own
    except ImportError:
        return
    for cls_name, build in (("RMSNorm", _rms_norm_from), ("SwiGLUMLP", _swiglu_from)):
        cls = getattr(own, cls_name, None)
        if cls is not None:
            _CONVERTERS.setdefault(cls, functools.partial(build, cls))


def _rms_norm_from(cls, orig: nn.Module, eps: float | None = None) -> nn.Module:
    """tritonspec.nn.RMSNorm sharing the original's weight (same Parameter object, same state_dict key), with the
    original's eps unless the rule gives one (the constructor checks it)."""
    if eps is None:
        eps = getattr(orig, "variance_epsilon", getattr(orig, "eps", 1e-6))
    new = cls(orig.weight.shape[0], eps)
    new.weight = orig.weight
    return new


def _swiglu_from(cls, orig: nn.Module) -> nn.Module:
    """tritonspec.nn.SwiGLUMLP reusing the original's gate/up/down Linear modules."""
    new = cls(orig.gate_proj.in_features, orig.gate_proj.out_features)
    for n in ("gate_proj", "up_proj", "down_proj"):
        setattr(new, n, getattr(orig, n))
    return new.to(device=orig.gate_proj.weight.device)


def _parent_in_use(model: nn.Module, path: str, module: nn.Module, original_parent: nn.Module) -> nn.Module:
    """The live parent when it still holds ``module`` under the same name (a replaced ancestor that reused
    its children), else the original parent (a replaced ancestor that wraps the original whole)."""
    parent_path, _, name = path.rpartition(".")
    try:
        live = model.get_submodule(parent_path) if parent_path else model
    except AttributeError:
        return original_parent
    return live if live._modules.get(name) is module else original_parent


def apply_rules(model: nn.Module, rules: str | Path | list, *, allowed_modules: Iterable[str] = ()) -> engine.Report:
    """Apply a rule file to ``model`` in place and return the report of what this call replaced.

    All-or-nothing: a rule that matches nothing (and is not ``optional``), a class that cannot be
    imported or does not fit, or a failing constructor raises :class:`RuleError` and leaves the model
    unchanged.
    """
    parsed = (
        rules if isinstance(rules, list) and rules and all(isinstance(r, Rule) for r in rules) else load_rules(rules)
    )
    allowed = DEFAULT_ALLOWED_MODULES + tuple(allowed_modules)
    classes = {
        r.index: _import_class(r, allowed)
        for r in parsed
        if r.replace_class is not None or r.replace_kernel is not None
    }

    # Plan on the original tree (first match wins, recursive: false prunes), then apply in pre-order.
    # Changes go to the matched objects themselves (and to their original parents), not to whatever a
    # path resolves to after an ancestor was replaced: a replacement may keep the original under another
    # attribute name (like KTransformers' orig_module), and the matched object is what the rule meant.
    plan: list[tuple[str, nn.Module, Rule]] = []
    hits = {r.index: 0 for r in parsed}

    parents: dict[str, nn.Module] = {}
    budget_left = MATCH_BUDGET_S

    def first_match(path, module) -> Rule | None:
        nonlocal budget_left
        for r in parsed:
            start = time.perf_counter()
            hit = r.matches(path, module, timeout=min(MATCH_TIMEOUT_S, budget_left))
            budget_left -= time.perf_counter() - start
            if hit:
                return r
        return None

    def prune(path, module):
        rule = first_match(path, module)
        if rule is not None:
            parent_path = path.rpartition(".")[0]
            parents[path] = model.get_submodule(parent_path) if parent_path else model
            hits[rule.index] += 1
            plan.append((path, module, rule))
            return not rule.recursive
        return False

    # the model itself first: a layer may replace its forward (the causal LM's head + loss)
    if not prune("", model):
        for _ in engine.iter_modules(model, prune):
            pass
    for r in parsed:
        if hits[r.index] == 0 and not r.optional:
            raise RuleError(r.index, "match", "matched no module (mark the rule optional: true if that is fine)")

    chosen = experts.Plan(model, "rules")
    with engine.transaction(model) as made:
        for path, module, rule in plan:
            cls = classes.get(rule.index)
            if cls is None:  # "default": keep the module as it is
                continue
            name = rule.replace_class or f"kernel {rule.replace_kernel}"
            detail = f"rule {rule.index}"
            live = module
            if _is_pure_layer(cls):
                if rule.kwargs:
                    raise RuleError(rule.index, "replace.kwargs", f"{name} is a stateless layer; it takes no kwargs")
                try:
                    validate_layer(cls, type(live), repo=name)
                except TypeError as e:
                    raise RuleError(rule.index, "replace.class", f"cannot replace {path}: {e}") from None
                if experts.dispatched(live):
                    chosen.choose(path, live, cls.forward, kernel=engine.qualname(cls.forward), detail=detail)
                else:
                    engine.replace_forward(
                        model,
                        live,
                        cls.forward,
                        path=path,
                        kernel=engine.qualname(cls.forward),
                        source="rules",
                        detail=detail,
                    )
            elif not path:
                raise RuleError(
                    rule.index,
                    "replace.class",
                    f"{name} would replace the model object itself; "
                    "only a stateless layer (a forward) can replace the root",
                )
            else:
                try:
                    new = _builder(rule, cls)(live, parent=parents[path], path=path)
                except RuleError:
                    raise
                except Exception as e:
                    raise RuleError(
                        rule.index,
                        "replace.kwargs",
                        f"building {name} for {path} failed: {type(e).__name__}: {_said(e)}",
                    ) from None
                new.train(live.training)
                engine.replace_module(
                    model,
                    path,
                    new,
                    kernel=engine.qualname(cls),
                    source="rules",
                    detail=detail,
                    parent=_parent_in_use(model, path, module, parents[path]),
                )
            logger.info("rules: %s (%s) -> %s [rule %d]", path, type(live).__name__, name, rule.index)
        chosen.apply()  # last: it may take back earlier calls' changes, which a rollback would not restore
    return made
