"""Hostile rule files end quickly with RuleError: billion-laughs aliases, regexes that compile to gigabytes or match
for minutes, kwargs that would only fail at the first forward.

Each test runs its cases in a fresh interpreter under an address-space cap, and each case has WALL_S from the line
that starts it: imports and setup (seconds on a loaded CI machine) are not what is tested. A regression fails here
instead of hanging or swapping CI.
"""

import json
import os
import resource
import select
import subprocess
import sys
import textwrap
import time

from tritonspec.nn import rules

# Importing torch + tritonspec.nn peaks at about 0.7 GiB of address space on CPU (VmPeak); 3 GiB leaves room for
# any honest rule file and none for the gigabytes the hostile ones took.
ADDRESS_SPACE = 3 * 2**30
WALL_S = 10  # for each case: from its "start" line to the next case's, or to the end of the process
IMPORT_S = 300

_PRELUDE = r'''
import json, math, sys
import torch
from torch import nn
import tritonspec.nn.modules  # a rule's replacement class, imported before the clock starts (it imports triton)
from tritonspec.nn import RuleError, apply_rules


class Norm(nn.Module):
    """LlamaRMSNorm's state (weight, variance_epsilon), with transformers' formula."""

    def __init__(self, n=8):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n))
        self.variance_epsilon = 1e-6

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


def llama(layers=2):
    """The module paths of a Llama causal LM (model.layers.0.self_attn.q_proj, ...), 8 wide."""
    def block():
        attn = nn.ModuleDict({p: nn.Linear(8, 8) for p in ("q_proj", "k_proj", "v_proj", "o_proj")})
        mlp = nn.ModuleDict({p: nn.Linear(8, 8) for p in ("gate_proj", "up_proj", "down_proj")})
        return nn.ModuleDict({"self_attn": attn, "mlp": mlp, "input_layernorm": Norm(),
                              "post_attention_layernorm": Norm()})
    inner = nn.ModuleDict({"embed_tokens": nn.Embedding(16, 8), "norm": Norm(),
                           "layers": nn.ModuleList(block() for _ in range(layers))})
    return nn.ModuleDict({"model": inner, "lm_head": nn.Linear(8, 16)})


def shared_nesting(levels=9, width=9):
    """width**levels strings through `levels` lists: the billion laughs without YAML."""
    value = "lol"
    for _ in range(levels):
        value = [value] * width
    return value


def run(label, rules):
    """Applies `rules` to a fresh model; prints the RuleError (or that there was none) as one JSON line."""
    print(json.dumps(["start", label]), flush=True)
    model = llama()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        apply_rules(model, rules)
    except RuleError as e:
        same = model.state_dict().keys() == before.keys() and all(
            torch.equal(v, before[k]) for k, v in model.state_dict().items())
        print(json.dumps(["RuleError", label, e.index, e.key, str(e), same]), flush=True)
    else:
        print(json.dumps(["accepted", label]), flush=True)


print(json.dumps(["ready"]), flush=True)
'''


def _cap_address_space():
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))


def _run_hostile(body: str, tmp_path) -> dict:
    """Runs ``_PRELUDE + body`` in a child; returns {label: (index, key, message, model_unchanged)} of its
    RuleErrors. Fails if a case (from its "start" line to the next, or to the end) takes over WALL_S, or the child
    ends any other way."""
    script, err_path = tmp_path / "hostile.py", tmp_path / "stderr.txt"
    script.write_text(_PRELUDE + textwrap.dedent(body))
    with open(err_path, "w") as err:
        child = subprocess.Popen(
            [sys.executable, str(script)], stdout=subprocess.PIPE, stderr=err, bufsize=0, preexec_fn=_cap_address_space
        )
    out, ended, started = b"", False, []
    deadline = time.monotonic() + IMPORT_S
    try:
        while not ended and select.select([child.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
            chunk = os.read(child.stdout.fileno(), 1 << 16)
            ended, out = not chunk, out + chunk
            lines = out.split(b"\n")[:-1]  # the complete ones
            cases = [json.loads(x)[1] for x in lines if x.startswith(b'["start"')]
            if len(cases) > len(started):  # a case began: its clock starts
                started, deadline = cases, time.monotonic() + WALL_S
    finally:
        if not ended:
            child.kill()
        child.wait()
        child.stdout.close()
    results = [json.loads(x) for x in out.decode().splitlines()]
    assert ended, (
        f"case {started[-1]!r} still running {WALL_S}s after it began"
        if started
        else f"imports and setup took over {IMPORT_S}s"
    )
    assert child.returncode == 0 and ["ready"] in results, (
        f"child failed (rc {child.returncode}): {err_path.read_text()[-3000:]}"
    )
    accepted = [r[1] for r in results if r[0] == "accepted"]
    assert not accepted, f"accepted without a RuleError: {accepted}"
    return {r[1]: tuple(r[2:]) for r in results if r[0] == "RuleError"}


def _laughs_yaml(levels=9, width=9) -> str:
    """A YAML flow list whose last item expands through aliases to width**levels strings (the billion laughs)."""
    items = [f"&l0 [{', '.join(['lol'] * width)}]"]
    items += [f"&l{i} [{', '.join([f'*l{i - 1}'] * width)}]" for i in range(1, levels)]
    return f"[{', '.join(items)}]"


_OK = "{match: {name: '^lm_head$'}, replace: {class: default}}"  # rule 0, so the hostile rule is rule 1
# Where a value goes (YAML rule with {v} for it) and the key its RuleError names.
_LAUGHS_AT = {
    "match.class": "{{match: {{class: {v}}}, replace: {{class: default}}}}",
    "match.name": "{{match: {{name: {v}}}, replace: {{class: default}}}}",
    "match.kernel": "{{match: {{kernel: {v}}}, replace: {{class: default}}}}",
    "replace.class": "{{match: {{name: norm}}, replace: {{class: {v}}}}}",
    "replace.kernel": "{{match: {{name: norm}}, replace: {{kernel: {v}}}}}",
    "replace.kwargs": "{{match: {{name: norm}}, replace: {{class: tritonspec.nn.RMSNorm, kwargs: {{eps: {v}}}}}}}",
    "recursive": "{{match: {{name: norm}}, replace: {{class: default}}, recursive: {v}}}",
    "optional": "{{match: {{name: norm}}, replace: {{class: default}}, optional: {v}}}",
}


def test_billion_laughs_end_quickly_with_a_rule_error(tmp_path):
    """Aliases (YAML) or shared lists (Python) at every key: the error message shows a bounded repr, and nothing
    walks the shared structure once per path."""
    cases = {}
    for key, rule in _LAUGHS_AT.items():
        text = f"- {_OK}\n- {rule.format(v=_laughs_yaml())}\n"
        assert len(text.encode()) < 1000  # the whole hostile file
        cases[f"yaml {key}"] = text
    body = f"cases = {cases!r}\nat = {_LAUGHS_AT!r}\n" + textwrap.dedent("""
        for label, text in cases.items():
            run(label, text)
        import yaml
        for key, rule in at.items():
            parsed = yaml.safe_load("- " + rule.format(v="LAUGHS"))
            def put(obj):
                if isinstance(obj, dict):
                    return {k: put(v) for k, v in obj.items()}
                return shared_nesting() if obj == "LAUGHS" else obj
            run(f"python {key}", [{"match": {"name": "^lm_head$"}, "replace": {"class": "default"}}, put(parsed[0])])
    """)
    errors = _run_hostile(body, tmp_path)
    for form in ("yaml", "python"):
        for key in _LAUGHS_AT:
            index, got_key, message, unchanged = errors[f"{form} {key}"]
            assert (index, got_key) == (1, key), (form, key, message)
            assert len(message) < 1000 and unchanged, (form, key, message)


# match.name patterns that compile huge; rule 0 is an ordinary one, so the hostile one is rule 1.
_HUGE_PATTERNS = {
    "a{4294967294}": "expands to over",  # regex's largest count: MemoryError at a 4-6 GB cap
    "a{10000000}": "expands to over",  # 17 s and 2.6 GB to compile
    "(a{1000}){1000}": "expands to over",  # nested counts multiply
    "((a|bc){1000}){1000}": "expands to over",  # segfaults in the regex compiler
    "x{0,100000}": "expands to over",  # an upper count counts too
    "(?x) (a{1000} # ) in a comment\n ){1000}": "expands to over",  # verbose mode, read as re reads it
    "a" * 100_000: "100000 characters",
}


def test_regexes_that_compile_huge_fail_fast_naming_rule_and_key(tmp_path):
    many = [
        {"match": {"name": f"a{{900}}b{{900}}{i}"}, "replace": {"class": "default"}, "optional": True}
        for i in range(1000)
    ]  # each small, together huge (distinct: regex caches compiled patterns)
    errors = _run_hostile(
        f"""
        for pattern in {list(_HUGE_PATTERNS)!r}:
            run(pattern, [{{"match": {{"name": "^lm_head$"}}, "replace": {{"class": "default"}}}},
                          {{"match": {{"name": pattern}}, "replace": {{"class": "default"}}}}])
        run("many", {many!r})
    """,
        tmp_path,
    )
    for pattern, says in _HUGE_PATTERNS.items():
        index, key, message, unchanged = errors[pattern]
        assert (index, key) == (1, "match.name") and says in message and unchanged, message
        assert len(message) < 1000
    index, key, message, unchanged = errors["many"]
    assert key == "match.name" and 0 < index < 1000 and unchanged
    assert f"may expand to {rules.MAX_REGEX_UNITS} together" in message and "the earlier patterns to" in message


def test_many_slow_patterns_exhaust_the_files_matching_budget(tmp_path):
    """Each search stays under the per-search timeout; together they would run for minutes."""
    errors = _run_hostile(
        """
        slow = r"^(?:\\w|\\w\\w|\\.){1,24}\\d$"
        run("budget", [{"match": {"name": slow}, "replace": {"class": "default"}} for _ in range(60)])
    """,
        tmp_path,
    )
    index, key, message, unchanged = errors["budget"]
    assert key == "match.name" and 0 <= index < 60 and unchanged
    assert f"all match.name searches of one apply_rules call may take {rules.MATCH_BUDGET_S}s" in message, message


def test_billion_laughs_in_a_replacement_classes_kwargs(tmp_path):
    """A replacement class's own argument checks quote the value bounded too (offloaded experts' kwargs)."""
    keys = ("experts_per_layer", "storage", "generate_device", "cpu_threads", "policy")
    errors = _run_hostile(
        f"""
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        import tritonspec.nn.offload
        config = Qwen3MoeConfig(hidden_size=16, intermediate_size=16, moe_intermediate_size=8, num_experts=4,
                                num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=1, vocab_size=32)
        for key in {keys!r}:
            kwargs = {{"experts_per_layer": 2, key: shared_nesting()}}
            print(json.dumps(["start", key]), flush=True)
            model = Qwen3MoeForCausalLM(config)
            before = {{k: v.clone() for k, v in model.state_dict().items()}}
            try:
                apply_rules(model, [{{"match": {{"kernel": "moe"}}, "replace": {{
                    "class": "tritonspec.nn.offload.OffloadedExperts", "kwargs": kwargs}}}}])
            except RuleError as e:
                same = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
                print(json.dumps(["RuleError", key, e.index, e.key, str(e), same]), flush=True)
            else:
                print(json.dumps(["accepted", key]), flush=True)
    """,
        tmp_path,
    )
    for key in keys:
        index, got_key, message, unchanged = errors[key]
        assert index == 0 and key in message and len(message) < 1000 and unchanged, (key, message)
