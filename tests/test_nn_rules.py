"""YAML rule front end (KTransformers' format): parsing errors, matching order, recursion, import safety,
atomicity, and the bounds on hostile files (regex timeout, nesting depth)."""

import re

import pytest
import torch
from torch import nn

import tritonspec.nn as tnn
from tritonspec.nn import RuleError, apply_rules, load_rules

HERE = __name__  # this test module, allowed explicitly where a test needs its own classes


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4).double()
        self.act = Act()

    def forward(self, x):
        return self.act(self.proj(x))


class Act(nn.Module):
    def forward(self, x):
        return torch.tanh(x)


class FastAct(nn.Module):
    """A pure layer: replaces Act.forward (same math)."""

    def forward(self, x):
        return torch.tanh(x) * 1.0


class Doubler(nn.Module):
    """A stateful replacement built from the original module via from_module."""

    def __init__(self, inner, factor):
        super().__init__()
        self.inner, self.factor = inner, factor

    @classmethod
    def from_module(cls, orig, factor=2.0):
        return cls(orig, factor)

    def forward(self, x):
        return self.inner(x) * self.factor


class NoBuilder(nn.Module):
    def __init__(self, n):
        super().__init__()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(Block(), Block())


def _x():
    return torch.randn(3, 4, dtype=torch.float64)


@pytest.mark.parametrize(
    "rules, index, key",
    [
        ("[]", None, "rules"),
        ("- 3", 0, "rule"),
        ("- {replace: {class: default}}", 0, "match"),
        ("- {match: {}, replace: {class: default}}", 0, "match"),
        ("- {match: {name: x, kind: y}, replace: {class: default}}", 0, "match.kind"),
        ("- {match: {name: '('}, replace: {class: default}}", 0, "match.name"),
        ("- {match: {name: 3}, replace: {class: default}}", 0, "match.name"),
        ("- {match: {class: NotDotted}, replace: {class: default}}", 0, "match.class"),
        ("- {match: {name: a}}", 0, "replace"),
        ("- {match: {name: a}, replace: {}}", 0, "replace"),
        ("- {match: {name: a}, replace: {class: default, kernel: rmsnorm}}", 0, "replace"),
        ("- {match: {name: a}, replace: {kernel: rmsnrom}}", 0, "replace.kernel"),
        ("- {match: {kernel: flash_attention}, replace: {class: default}}", 0, "match.kernel"),
        ("- {match: {name: a}, replace: {class: 'os; rm'}}", 0, "replace.class"),
        ("- {match: {name: a}, replace: {class: default, device: cuda}}", 0, "replace.device"),
        ("- {match: {name: a}, replace: {class: default, kwargs: [1]}}", 0, "replace.kwargs"),
        (
            "- {match: {name: a}, replace: {class: default}}\n"
            "- {match: {name: b}, replace: {class: default}, recursive: no_}",
            1,
            "recursive",
        ),
        ("- {match: {name: a}, replace: {class: default}, optional: 1}", 0, "optional"),
        ("- {match: {name: a}, replace: {class: default}, device: cpu}", 0, "device"),
        ("- {match: {name: a}\n  replace: [", None, "yaml"),
    ],
)
def test_parse_errors_name_rule_and_key(rules, index, key):
    with pytest.raises(RuleError) as ei:
        load_rules(rules)
    assert ei.value.index == index and ei.value.key == key
    assert (f"rule {index}: {key}:" if index is not None else f"{key}:") in str(ei.value)


def test_load_from_file_and_missing_file(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("- match: {name: '^0$'}\n  replace: {class: default}\n")
    assert load_rules(p)[0].name.pattern == "^0$"
    assert load_rules(str(p))[0].recursive is True
    with pytest.raises(FileNotFoundError, match="source: rule file"):
        load_rules(tmp_path / "missing.yaml")


def test_pure_layer_replaces_forward_and_reverts():
    model, x = _model(), _x()
    ref = model(x)
    rep = apply_rules(
        model, f"- match: {{class: {HERE}.Act}}\n  replace: {{class: {HERE}.FastAct}}\n", allowed_modules=[HERE]
    )
    assert rep.paths() == ["0.act", "1.act"] and all(c.what == "forward" and c.detail == "rule 0" for c in rep)
    assert model[0].act.forward.__func__ is FastAct.forward
    torch.testing.assert_close(model(x), ref)
    tnn.revert(model)
    assert "forward" not in vars(model[0].act)


def test_module_replacement_with_kwargs_shares_original():
    model, x = _model(), _x()
    ref = model(x)
    old = model[1].proj
    rep = apply_rules(
        model,
        [{"match": {"name": r"^1\.proj$"}, "replace": {"class": f"{HERE}.Doubler", "kwargs": {"factor": 3.0}}}],
        allowed_modules=[HERE],
    )
    assert rep[0].what == "module" and isinstance(model[1].proj, Doubler) and model[1].proj.inner is old
    assert torch.allclose(model(x), ref) is False
    tnn.revert(model)
    assert model[1].proj is old
    torch.testing.assert_close(model(x), ref)


def test_first_match_wins_and_and_semantics():
    model = _model()
    rules = [
        {"match": {"name": r"^0\.", "class": f"{HERE}.Act"}, "replace": {"class": "default"}},  # shields 0.act
        {"match": {"class": f"{HERE}.Act"}, "replace": {"class": f"{HERE}.FastAct"}},
    ]
    rep = apply_rules(model, rules, allowed_modules=[HERE])
    assert rep.paths() == ["1.act"]


def test_recursive_false_stops_descent():
    model = _model()
    rules = [
        {"match": {"name": r"^0$"}, "replace": {"class": "default"}, "recursive": False},
        {"match": {"class": f"{HERE}.Act"}, "replace": {"class": f"{HERE}.FastAct"}},
    ]
    assert apply_rules(model, rules, allowed_modules=[HERE]).paths() == ["1.act"]


def test_child_of_replaced_module_is_found_in_new_parent():
    model = _model()
    rules = [
        {"match": {"name": r"^0$"}, "replace": {"class": f"{HERE}.Doubler"}},
        {"match": {"class": f"{HERE}.Act"}, "replace": {"class": f"{HERE}.FastAct"}},
    ]
    rep = apply_rules(model, rules, allowed_modules=[HERE])
    assert rep.paths() == ["0", "0.act", "1.act"]  # Doubler keeps the block under .inner; the rule
    assert model[0].inner.act.forward.__func__ is FastAct.forward  # still reaches the matched Act
    tnn.revert(model)
    assert isinstance(model[0], Block) and "forward" not in vars(model[0].act)


def test_rule_matching_nothing_fails_unless_optional():
    model = _model()
    rules = [
        {"match": {"class": f"{HERE}.Act"}, "replace": {"class": f"{HERE}.FastAct"}},
        {"match": {"name": "nowhere"}, "replace": {"class": "default"}},
    ]
    with pytest.raises(RuleError, match="rule 1: match: matched no module"):
        apply_rules(model, rules, allowed_modules=[HERE])
    assert tnn.report(model) == []  # nothing applied
    rules[1]["optional"] = True
    assert len(apply_rules(model, rules, allowed_modules=[HERE])) == 2


@pytest.mark.parametrize("cls", ["collections.OrderedDict", "torch.nn.Linear", "tritonspec_evil.Thing", f"{HERE}.Act"])
def test_replace_class_outside_allowed_modules_is_never_imported(cls):
    with pytest.raises(RuleError, match="rule 0: replace.class: .* is outside the allowed modules"):
        apply_rules(_model(), [{"match": {"name": "act"}, "replace": {"class": cls}}])


def test_match_class_imports_nothing():
    # A dotted name that does not exist anywhere simply matches nothing: it is compared, not imported.
    with pytest.raises(RuleError, match="rule 0: match: matched no module"):
        apply_rules(_model(), [{"match": {"class": "evil.module.Payload"}, "replace": {"class": "default"}}])


@pytest.mark.parametrize(
    "replace, key, match",
    [
        ({"class": "tritonspec.nn.engine.Nope"}, "replace.class", "cannot import"),
        ({"class": "tritonspec.nn.engine.Change"}, "replace.class", "not a torch.nn.Module subclass"),
        ({"class": f"{HERE}.FastAct", "kwargs": {"a": 1}}, "replace.kwargs", "stateless layer"),
        ({"class": f"{HERE}.NoBuilder"}, "replace.class", "neither a stateless layer nor has a from_module"),
        ({"class": f"{HERE}.Doubler", "kwargs": {"bogus": 1}}, "replace.kwargs", "building .*Doubler.* failed"),
    ],
)
def test_bad_replacements_name_rule_and_key(replace, key, match):
    model = _model()
    rules = [
        {"match": {"name": r"^1\.act$"}, "replace": {"class": "default"}},
        {"match": {"name": r"act$"}, "replace": replace},
    ]
    with pytest.raises(RuleError, match=f"rule 1: {key}: .*{match}"):
        apply_rules(model, rules, allowed_modules=[HERE])
    assert tnn.report(model) == []


def test_incompatible_pure_layer_is_rejected():
    class TwoArgs(nn.Module):
        def forward(self, x, y):
            return x

    import sys

    sys.modules[HERE].TwoArgs = TwoArgs
    try:
        with pytest.raises(RuleError, match="rule 0: replace.class: cannot replace 0.act: .*takes 3 parameters"):
            apply_rules(
                _model(),
                [{"match": {"name": r"^0\.act$"}, "replace": {"class": f"{HERE}.TwoArgs"}}],
                allowed_modules=[HERE],
            )
    finally:
        del sys.modules[HERE].TwoArgs


def test_register_module_converter(monkeypatch):
    built = []

    def build(orig, **kw):
        built.append(kw)
        return Doubler(orig, kw.get("factor", 2.0))

    monkeypatch.setattr("tritonspec.nn.rules._CONVERTERS", {})
    tnn.register_module_converter(NoBuilder, build)
    model = _model()
    apply_rules(
        model,
        [{"match": {"name": r"^0\.act$"}, "replace": {"class": f"{HERE}.NoBuilder", "kwargs": {"factor": 5.0}}}],
        allowed_modules=[HERE],
    )
    assert built == [{"factor": 5.0}] and isinstance(model[0].act, Doubler)


class Rebuilt(nn.Module):
    """A stateful replacement that reuses the original's children under the same names."""

    def __init__(self, proj, act):
        super().__init__()
        self.proj, self.act = proj, act

    @classmethod
    def from_module(cls, orig):
        return cls(orig.proj, orig.act)

    def forward(self, x):
        return self.act(self.proj(x))


def test_child_module_replacement_lands_in_the_live_parent():
    model, x = _model(), _x()
    ref = model(x)
    rules = [
        {"match": {"name": r"^0$"}, "replace": {"class": f"{HERE}.Rebuilt"}},
        {"match": {"name": r"^0\.proj$"}, "replace": {"class": f"{HERE}.Doubler", "kwargs": {"factor": 1.0}}},
    ]
    apply_rules(model, rules, allowed_modules=[HERE])
    assert isinstance(model[0], Rebuilt) and isinstance(model[0].proj, Doubler)
    torch.testing.assert_close(model(x), ref)
    tnn.revert(model)
    assert isinstance(model[0], Block) and isinstance(model[0].proj, nn.Linear)


def _chain(depth, name="x"):
    """``depth`` modules nested under "0" (paths 0, 0.0, ...), the innermost holding a child ``name``."""
    model = nn.ModuleDict({name: nn.Identity()})
    for _ in range(depth):
        model = nn.Sequential(model)
    return nn.Sequential(model)


@pytest.mark.parametrize(
    "pattern, model",
    [
        (r"^(a|aa)+$", lambda: nn.ModuleDict({"a" * 40 + "b": nn.Identity()})),  # a long module name
        (r"^(0|0\.|\.0|\.)+$", lambda: _chain(30)),  # a long dotted path, 0.0.(...).0.x
    ],
)
def test_catastrophic_name_regex_raises_instead_of_hanging(pattern, model):
    # re.search backtracks exponentially here (forever, in practice); the regex package gives up at the timeout.
    with pytest.raises(RuleError, match=r"rule 0: match\.name: .* timed out after"):
        apply_rules(model(), [{"match": {"name": pattern}, "replace": {"class": "default"}}])


def test_nested_quantifier_that_regex_rejects_fast_terminates():
    # The classic (x+)+X: re never returns on 40 characters; regex sees X is missing and matches nothing at once.
    with pytest.raises(RuleError, match="rule 0: match: matched no module"):
        apply_rules(
            nn.ModuleDict({"a" * 40: nn.Identity()}),
            [{"match": {"name": "^([a-z_0-9]+)+X$"}, "replace": {"class": "default"}}],
        )


@pytest.mark.parametrize(
    "pattern",
    [
        r"^0\.act$",
        r"act$",
        r"^\d+\.(proj|act)$",
        r"PROJ",
        r"(?i)PROJ",
        r"^1",
        r"\bact",
        r"^(?:0|1)\.p\w+$",
        r"^(?!0)",
        r"\.act$|^0$",
        r"[^.]+\.[^.]+",
    ],
)
def test_ordinary_patterns_match_as_re_search_did(pattern):
    rule = load_rules([{"match": {"name": pattern}, "replace": {"class": "default"}}])[0]
    for path, module in _model().named_modules():
        assert rule.matches(path, module) == bool(re.search(pattern, path)), path


def _nest(depth, leaf=1, key=None):
    """``depth`` lists (or single-key mappings) around ``leaf``, built without recursion."""
    for _ in range(depth):
        leaf = {key: leaf} if key else [leaf]
    return leaf


def _nest_yaml(depth, key=None):
    return f"{{{key}: " * depth + "1" + "}" * depth if key else "[" * depth + "1" + "]" * depth


_R0 = "- match: {name: act}\n  replace: {class: default}\n"


@pytest.mark.parametrize(
    "yaml_text, python, index, key",
    [
        (
            _R0 + f"- match: {{name: act}}\n  replace: {{class: default, kwargs: {{x: {_nest_yaml(500)}}}}}\n",
            [
                {"match": {"name": "act"}, "replace": {"class": "default"}},
                {"match": {"name": "act"}, "replace": {"class": "default", "kwargs": {"x": _nest(500)}}},
            ],
            1,
            "replace.kwargs.x",
        ),
        (
            f"- match: {{name: act}}\n  replace: {{class: default, kwargs: {_nest_yaml(500, 'a')}}}\n",
            [{"match": {"name": "act"}, "replace": {"class": "default", "kwargs": _nest(500, key="a")}}],
            0,
            "replace.kwargs.a",
        ),
        (
            _R0 + f"  optional: {_nest_yaml(500)}\n",
            [{"match": {"name": "act"}, "replace": {"class": "default"}, "optional": _nest(500)}],
            0,
            "optional",
        ),
        (f"- match: {{name: {_nest_yaml(500)}}}\n", [{"match": {"name": _nest(500)}}], 0, "match.name"),
        (f"- {_nest_yaml(500)}\n", [_nest(500)], 0, "rule"),
        (_nest_yaml(500, "a"), None, None, "rules"),
    ],
)
def test_deep_nesting_raises_rule_error_naming_the_key(yaml_text, python, index, key):
    for source in (yaml_text, python):
        if source is None:
            continue
        with pytest.raises(RuleError, match=f"nested deeper than {tnn.rules.MAX_NESTING_DEPTH} levels") as ei:
            load_rules(source)
        assert (ei.value.index, ei.value.key) == (index, key)


def test_nesting_limit_is_the_same_for_yaml_and_python():
    limit = tnn.rules.MAX_NESTING_DEPTH
    for depth, ok in ((limit - 4, True), (limit - 3, False)):  # rule list, rule, replace, kwargs: 4 levels
        python = [{"match": {"name": "act"}, "replace": {"class": "default", "kwargs": {"x": _nest(depth)}}}]
        text = f"- match: {{name: act}}\n  replace: {{class: default, kwargs: {{x: {_nest_yaml(depth)}}}}}\n"
        for source in (python, text):
            if ok:
                assert load_rules(source)[0].kwargs == {"x": _nest(depth)}
            else:
                with pytest.raises(RuleError, match=r"rule 0: replace\.kwargs\.x: nested deeper"):
                    load_rules(source)


def test_cyclic_and_widely_shared_python_rules():
    cycle = []
    cycle.append(cycle)
    with pytest.raises(RuleError, match=r"rule 0: replace\.kwargs\.c: .*contains itself"):
        load_rules([{"match": {"name": "act"}, "replace": {"class": "default", "kwargs": {"c": cycle}}}])
    shared = 1
    for _ in range(25):  # 2**25 paths through 25 objects (YAML aliases make the same): checked once each
        shared = [shared, shared]
    assert load_rules([{"match": {"name": "act"}, "replace": {"class": "default", "kwargs": {"s": shared}}}])


def test_regex_with_deeply_nested_groups_is_a_rule_error():
    with pytest.raises(RuleError, match=r"rule 0: match\.name: regex nests its groups too deeply"):
        load_rules([{"match": {"name": "(" * 500 + "a" + ")" * 500}, "replace": {"class": "default"}}])


def test_regex_depth_limit_does_not_depend_on_the_recursion_limit():
    """torch.compile raises the recursion limit; a rule nesting 100 groups fails the same way there."""
    import sys

    deep = "(" * 100 + "a" + ")" * 100
    previous = sys.getrecursionlimit()
    sys.setrecursionlimit(20_000)
    try:
        with pytest.raises(RuleError, match="nests its groups too deeply"):
            load_rules([{"match": {"name": deep}, "replace": {"class": "default"}}])
    finally:
        sys.setrecursionlimit(previous)


def test_parentheses_in_character_classes_and_escapes_are_not_groups():
    name = r"[(]" * 80 + r"\(" * 80 + "[^)(]x"
    rules = load_rules([{"match": {"name": name}, "replace": {"class": "default"}}])
    assert len(rules) == 1


def test_the_root_module_matches_too():
    """A rule may name the model itself (the causal LM's head + loss is its forward): a pure layer rebinds the
    root's forward; a class would have to replace the model object, which is a clear error."""
    block = Block()
    x = _x()
    want = block(x)
    made = apply_rules(
        block, f"- {{match: {{class: {HERE}.Block}}, replace: {{class: {HERE}.FastBlock}}}}", allowed_modules=[HERE]
    )
    assert [c.path for c in made] == [""]
    assert torch.equal(block(x), want * 1.0) and block.forward.__func__ is FastBlock.forward
    tnn.revert(block)
    with pytest.raises(RuleError, match="replace the model object itself"):
        apply_rules(
            Block(), f"- {{match: {{class: {HERE}.Block}}, replace: {{class: {HERE}.Doubler}}}}", allowed_modules=[HERE]
        )


class FastBlock(nn.Module):
    """A pure layer for Block: its forward, reading the module's own children."""

    def forward(self, x):
        return self.act(self.proj(x)) * 1.0


class Norm(nn.Module):
    """LlamaRMSNorm's state (weight, variance_epsilon) and formula."""

    def __init__(self, n=8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def _normed():
    torch.manual_seed(0)
    return nn.ModuleDict({"block": Block(), "norm": Norm()})


def _norm_rule(kwargs):
    return [{"match": {"class": f"{HERE}.Norm"}, "replace": {"class": "tritonspec.nn.RMSNorm", "kwargs": kwargs}}]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"eps": [1e-6]}, "TypeError: eps: expected a number, got list"),
        ({"eps": "1e-6"}, "TypeError: eps: expected a number, got the string '1e-6' .*write 1.0e-6"),
        ({"eps": float("nan")}, "ValueError: eps: expected a finite number >= 0, got nan"),
        ({"eps": float("inf")}, "ValueError: eps: expected a finite number >= 0, got inf"),
        ({"eps": -1e-6}, "ValueError: eps: expected a finite number >= 0, got -1e-06"),
        ({"eps": True}, "TypeError: eps: expected a number, got bool"),
        ({"eps": 10**400}, "ValueError: eps: expected a finite number >= 0, got inf"),
        ({"epsilon": 1e-6}, r"TypeError: unknown kwarg epsilon; did you mean 'eps'\?; it takes eps"),
    ],
)
def test_wrong_kwargs_fail_when_the_rule_is_applied(kwargs, match):
    model = _normed()
    norm, before = model["norm"], {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        RuleError, match=f"rule 0: replace.kwargs: building tritonspec.nn.RMSNorm for norm failed: {match}"
    ):
        apply_rules(model, _norm_rule(kwargs))
    assert model["norm"] is norm and tnn.report(model) == []
    assert model.state_dict().keys() == before.keys()
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())


def test_yaml_eps_needs_a_dot_to_be_a_number():
    """YAML 1.1 (PyYAML) reads 1e-6 as a string: the rule fails at apply_rules, not at the first forward."""
    rule = f"- match: {{class: {HERE}.Norm}}\n  replace: {{class: tritonspec.nn.RMSNorm, kwargs: {{eps: %s}}}}\n"
    with pytest.raises(RuleError, match="rule 0: replace.kwargs: .*eps: expected a number, got the string '1e-6'"):
        apply_rules(_normed(), rule % "1e-6")
    model, x = _normed(), torch.randn(3, 8)
    original = model["norm"]
    original.variance_epsilon = 1e-2  # the reference: the original module with the rule's eps
    want = original(x)
    apply_rules(model, rule % "1.0e-2")
    assert isinstance(model["norm"], tnn.RMSNorm) and model["norm"].weight is original.weight
    assert model["norm"].variance_epsilon == 1e-2
    torch.testing.assert_close(model["norm"](x), want)


@pytest.mark.parametrize("eps, want", [(0, 0.0), (1, 1.0), (None, 1e-6)])  # None: the original's
def test_number_kwargs_become_floats(eps, want):
    model = _normed()
    apply_rules(model, _norm_rule({"eps": eps}))
    assert type(model["norm"].variance_epsilon) is float and model["norm"].variance_epsilon == want


def test_builder_without_kwargs_names_the_unknown_one():
    model = nn.ModuleDict({"mlp": nn.Module()})
    with pytest.raises(RuleError, match="rule 0: replace.kwargs: .*unknown kwarg in_place; it takes none"):
        apply_rules(
            model,
            [
                {
                    "match": {"name": "^mlp$"},
                    "replace": {"class": "tritonspec.nn.SwiGLUMLP", "kwargs": {"in_place": False}},
                }
            ],
        )


def test_real_rule_files_fit_the_regex_bounds():
    """KTransformers-style patterns (lookaheads, layer ranges, a 48-layer alternation, counted repetitions) in one
    file stay far inside the bounds on length and compiled size, and match as re.search does."""
    patterns = [
        r"^model\.layers\..*\.mlp\.experts$",
        r"^model\.layers\.([0-9]|[1-5][0-9]|6[0-3])\.mlp$",
        r"^model\.layers\.(?!.*self_attn\.kv_b_proj).*$",
        r"^lm_head$",
        r"^model\.embed_tokens",
        r"^model\.layers\.\d{1,3}\.(self_attn|mlp)\.\w+_proj$",
        r"^model(\.\w+){0,8}\.experts\.\d{1,4}$",
        r"^model\.layers\.(" + "|".join(str(i) for i in range(0, 96, 2)) + r")\.mlp\.gate$",
    ] * 4
    rules = load_rules([{"match": {"name": p}, "replace": {"class": "default"}} for p in patterns])
    paths = [
        "model.layers.17.mlp.experts",
        "model.layers.64.mlp",
        "model.layers.3.self_attn.kv_b_proj",
        "lm_head",
        "model.layers.250.self_attn.q_proj",
        "model.layers.2.mlp.experts.127",
        "model.layers.94.mlp.gate",
    ]
    for rule, pattern in zip(rules, patterns):
        for path in paths:
            assert rule.matches(path, nn.Identity()) == bool(re.search(pattern, path)), (pattern, path)
