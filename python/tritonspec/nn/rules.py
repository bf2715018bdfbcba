"""YAML injection rules (KTransformers' format, seed 004) on the shared engine.

A rule file is a list of::

    - match:                      # at least one of name/class; both must hold
        name: "^model\\.layers\\.\\d+\\.mlp$"      # re.search on the dotted module path
        class: transformers.models.llama.modeling_llama.LlamaMLP   # isinstance, by dotted name
      replace:
        class: tritonspec.nn.hub.layers.SwiGLUMLP  # or "default": keep the module as it is
        kwargs: {}                # for module classes: passed to the constructor
      recursive: true             # false: do not look at this module's children
      optional: false             # true: matching nothing is not an error

The walk is pre-order; for each module the first matching rule wins. Why the import restrictions: a
rule file is data, and must never be a way to run arbitrary code. ``match.class`` is compared by name
against the module's class hierarchy and imports nothing; ``replace.class`` is imported only from
modules under an allowed prefix (``tritonspec`` plus what the caller passes).

A replacement class is either a hub-style pure layer (validated like kernelize's; its ``forward`` is
bound onto the matched module) or an ``nn.Module`` to put in the module's place. For the latter the class
(or a converter registered with :func:`register_module_converter`) builds it from the original module,
sharing its parameters, so training updates survive ``revert``.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from torch import nn

from . import engine
from .repository import validate_layer

logger = logging.getLogger("tritonspec.nn.rules")

DEFAULT_ALLOWED_MODULES = ("tritonspec",)
_RULE_KEYS = {"match", "replace", "recursive", "optional"}
_MATCH_KEYS = {"name", "class"}
_REPLACE_KEYS = {"class", "kwargs"}
_DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


class RuleError(ValueError):
    """A rule file problem; the message names the rule index and the offending key."""

    def __init__(self, index: int | None, key: str, message: str):
        where = f"rule {index}: " if index is not None else ""
        super().__init__(f"{where}{key}: {message}")
        self.index, self.key = index, key


@dataclass
class Rule:
    index: int
    name: re.Pattern | None
    match_class: str | None
    replace_class: str | None  # None means "default"
    kwargs: dict = field(default_factory=dict)
    recursive: bool = True
    optional: bool = False

    def matches(self, path: str, module: nn.Module) -> bool:
        if self.name is not None and not self.name.search(path):
            return False
        if self.match_class is not None and self.match_class not in _class_names(type(module)):
            return False
        return True


def _class_names(cls) -> set[str]:
    return {f"{c.__module__}.{c.__qualname__}" for c in cls.__mro__}


def _allowed(dotted: str, allowed: Iterable[str]) -> bool:
    return any(dotted == p or dotted.startswith(p.rstrip(".") + ".") for p in allowed)


def _parse_rule(i: int, raw: Any) -> Rule:
    if not isinstance(raw, dict):
        raise RuleError(i, "rule", f"expected a mapping with match/replace, got {type(raw).__name__}")
    unknown = set(raw) - _RULE_KEYS
    if unknown:
        raise RuleError(i, sorted(unknown)[0], f"unknown key (allowed: {', '.join(sorted(_RULE_KEYS))})")
    match = raw.get("match")
    if not isinstance(match, dict):
        raise RuleError(i, "match", "required, a mapping with name and/or class")
    unknown = set(match) - _MATCH_KEYS
    if unknown:
        raise RuleError(i, f"match.{sorted(unknown)[0]}", "unknown key (allowed: name, class)")
    if not match.get("name") and not match.get("class"):
        raise RuleError(i, "match", "needs at least one of name, class")
    pattern = None
    if "name" in match:
        if not isinstance(match["name"], str):
            raise RuleError(i, "match.name", f"expected a regex string, got {type(match['name']).__name__}")
        try:
            pattern = re.compile(match["name"])
        except re.error as e:
            raise RuleError(i, "match.name", f"invalid regex {match['name']!r}: {e}") from None
    match_class = match.get("class")
    if match_class is not None and (not isinstance(match_class, str) or not _DOTTED.match(match_class)):
        raise RuleError(i, "match.class", f"expected a dotted class name like pkg.module.Class, got {match_class!r}")
    replace = raw.get("replace")
    if not isinstance(replace, dict):
        raise RuleError(i, "replace", "required, a mapping with class and optional kwargs")
    unknown = set(replace) - _REPLACE_KEYS
    if unknown:
        raise RuleError(i, f"replace.{sorted(unknown)[0]}", "unknown key (allowed: class, kwargs)")
    rclass = replace.get("class")
    if not isinstance(rclass, str) or not (rclass == "default" or _DOTTED.match(rclass)):
        raise RuleError(i, "replace.class", f"expected 'default' or a dotted class name, got {rclass!r}")
    kwargs = replace.get("kwargs", {}) or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RuleError(i, "replace.kwargs", "expected a mapping of keyword arguments")
    flags = {}
    for key, default in (("recursive", True), ("optional", False)):
        v = raw.get(key, default)
        if not isinstance(v, bool):
            raise RuleError(i, key, f"expected true or false, got {v!r}")
        flags[key] = v
    return Rule(i, pattern, match_class, None if rclass == "default" else rclass, dict(kwargs), **flags)


def load_rules(source: str | Path | list) -> list[Rule]:
    """Parse rules from a YAML file path, a YAML string, or an already-loaded list; validates everything."""
    if isinstance(source, Path) or (isinstance(source, str) and "\n" not in source and source.endswith((".yaml", ".yml"))):
        path = Path(source)
        if not path.is_file():
            raise FileNotFoundError(f"source: rule file {path} does not exist")
        source = path.read_text()
    if isinstance(source, str):
        import yaml
        try:
            source = yaml.safe_load(source)  # safe_load: YAML tags cannot construct Python objects
        except yaml.YAMLError as e:
            raise RuleError(None, "yaml", str(e)) from None
    if not isinstance(source, list) or not source:
        raise RuleError(None, "rules", "a rule file is a non-empty list of rules")
    return [_parse_rule(i, r) for i, r in enumerate(source)]


_CONVERTERS: dict[type, Callable[..., nn.Module]] = {}


def register_module_converter(cls: type, build: Callable[..., nn.Module]) -> None:
    """``build(original_module, **kwargs) -> instance of cls`` for classes without a ``from_module`` classmethod."""
    _CONVERTERS[cls] = build


def _import_class(rule: Rule, allowed: tuple[str, ...]) -> type:
    dotted = rule.replace_class
    if not _allowed(dotted, allowed):
        raise RuleError(rule.index, "replace.class", f"{dotted} is outside the allowed modules "
                        f"({', '.join(allowed)}); pass allowed_modules=[...] to allow it")
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


def _builder(rule: Rule, cls: type) -> Callable[[nn.Module], nn.Module]:
    from_module = getattr(cls, "from_module", None)
    if callable(from_module):
        return lambda orig: from_module(orig, **rule.kwargs)
    build = _CONVERTERS.get(cls)
    if build is None:
        _load_builtin_converters()
        build = _CONVERTERS.get(cls)
    if build is None:
        raise RuleError(rule.index, "replace.class", f"{rule.replace_class} is neither a stateless layer nor has "
                        "a from_module(original, **kwargs) classmethod or a registered converter")
    return lambda orig: build(orig, **rule.kwargs)


def _load_builtin_converters() -> None:
    try:
        from . import layers as own
    except ImportError:
        return
    for cls_name, build in (("RMSNorm", _rms_norm_from), ("SwiGLUMLP", _swiglu_from)):
        cls = getattr(own, cls_name, None)
        if cls is not None:
            _CONVERTERS.setdefault(cls, lambda orig, _cls=cls, _b=build, **kw: _b(_cls, orig, **kw))


def _rms_norm_from(cls, orig: nn.Module, **kwargs) -> nn.Module:
    """tritonspec.nn.RMSNorm sharing the original's weight (same Parameter object, same state_dict key)."""
    eps = kwargs.pop("eps", getattr(orig, "variance_epsilon", getattr(orig, "eps", 1e-6)))
    if kwargs:
        raise TypeError(f"unexpected kwargs {sorted(kwargs)}")
    new = cls(orig.weight.shape[0], eps)
    new.weight = orig.weight
    return new


def _swiglu_from(cls, orig: nn.Module, **kwargs) -> nn.Module:
    """tritonspec.nn.SwiGLUMLP reusing the original's gate/up/down Linear modules."""
    if kwargs:
        raise TypeError(f"unexpected kwargs {sorted(kwargs)}")
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
    parsed = rules if isinstance(rules, list) and rules and all(isinstance(r, Rule) for r in rules) \
        else load_rules(rules)
    allowed = DEFAULT_ALLOWED_MODULES + tuple(allowed_modules)
    classes = {r.index: _import_class(r, allowed) for r in parsed if r.replace_class is not None}

    # Plan on the original tree (first match wins, recursive: false prunes), then apply in pre-order.
    # Changes go to the matched objects themselves (and to their original parents), not to whatever a
    # path resolves to after an ancestor was replaced: a replacement may keep the original under another
    # attribute name (like KTransformers' orig_module), and the matched object is what the rule meant.
    plan: list[tuple[str, nn.Module, Rule]] = []
    hits = {r.index: 0 for r in parsed}

    parents: dict[str, nn.Module] = {}

    def prune(path, module):
        rule = next((r for r in parsed if r.matches(path, module)), None)
        if rule is not None:
            parent_path = path.rpartition(".")[0]
            parents[path] = model.get_submodule(parent_path) if parent_path else model
            hits[rule.index] += 1
            plan.append((path, module, rule))
            return not rule.recursive
        return False

    for _ in engine.iter_modules(model, prune):
        pass
    for r in parsed:
        if hits[r.index] == 0 and not r.optional:
            raise RuleError(r.index, "match", "matched no module (mark the rule optional: true if that is fine)")

    with engine.transaction(model) as made:
        for path, module, rule in plan:
            if rule.replace_class is None:
                continue
            cls = classes[rule.index]
            detail = f"rule {rule.index}"
            live = module
            if _is_pure_layer(cls):
                if rule.kwargs:
                    raise RuleError(rule.index, "replace.kwargs", f"{rule.replace_class} is a stateless layer; "
                                    "it takes no kwargs")
                try:
                    validate_layer(cls, type(live), repo=rule.replace_class)
                except TypeError as e:
                    raise RuleError(rule.index, "replace.class", f"cannot replace {path}: {e}") from None
                engine.replace_forward(model, live, cls.forward, path=path, kernel=engine.qualname(cls.forward),
                                       source="rules", detail=detail)
            else:
                try:
                    new = _builder(rule, cls)(live)
                except RuleError:
                    raise
                except Exception as e:
                    raise RuleError(rule.index, "replace.kwargs", f"building {rule.replace_class} for {path} "
                                    f"failed: {type(e).__name__}: {e}") from None
                new.train(live.training)
                engine.replace_module(model, path, new, kernel=engine.qualname(cls), source="rules", detail=detail,
                                      parent=_parent_in_use(model, path, module, parents[path]))
            logger.info("rules: %s (%s) -> %s [rule %d]", path, type(live).__name__, rule.replace_class, rule.index)
    return made
