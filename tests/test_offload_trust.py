"""Offloaded experts never lose or substitute weights, whatever the checkpoint, the model or the failure.

The model's in-memory weights are the truth: a model fine-tuned since it was saved is served its own experts
(only meta ones come from the checkpoint), saves them, and gets them back bit for bit on revert. Hostile or
mismatched checkpoints (malformed safetensors headers, index paths leaving the folder, other shapes), a
checkpoint truncated under a running model, an expert-parallel model, an absent device: each ends in the
correct result or an error naming the file or argument and the problem, with every state_dict tensor of the
model torch.equal to before the call. Deep copies are independent and revertable; pickles are refused.
The model is a tiny float32 Qwen3-MoE; checkpoints are written by its own ``save_pretrained``.
"""

import copy
import io
import json
import os
import pickle
import re
import subprocess
import sys
import textwrap

import pytest
from helpers import build_model, generator, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn.offload import OffloadedExperts, offload_experts, offload_handle

transformers = pytest.importorskip("transformers")
pytest.importorskip("transformers.integrations.moe")
safetensors = pytest.importorskip("safetensors")

SIZES = dict(
    hidden_size=32,
    intermediate_size=16,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_hidden_layers=3,
)
MOE = dict(num_experts=8, num_experts_per_tok=2)
SEED = 4321
# Fine-tuned since saving: these experts of these layers move far from the checkpoint's (weights are ~0.02).
TUNED = {1: (2, 5), 2: tuple(range(8))}


def _model(dtype=torch.float32, **moe):
    return build_model("qwen3_moe", dtype, seed=SEED, moe={**MOE, **moe}, **SIZES).eval()


def _logits(model, ids=None):
    with torch.no_grad():
        return model(input_ids=token_ids(96, batch=1, seq=5) if ids is None else ids).logits


def _experts(model):
    return [blk.mlp.experts for blk in model.model.layers]


def _fine_tune(model, tuned=TUNED):
    gen = generator()
    with torch.no_grad():
        for layer, experts in tuned.items():
            module = _experts(model)[layer]
            for name in ("gate_up_proj", "down_proj"):
                p = getattr(module, name)
                for e in experts:
                    p[e] += 0.5 * torch.randn(p.shape[1:], generator=gen)
    return model


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_state(model, before):
    """Every state_dict entry equal to ``before``: same keys, dtypes, shapes, devices and bits."""
    now = model.state_dict()
    assert now.keys() == before.keys()
    for k, v in now.items():
        b = before[k]
        assert (v.dtype, v.shape, v.device) == (b.dtype, b.shape, b.device), k
        assert v.is_meta or torch.equal(v, b), k


def _assert_as_before(model, before, report=()):
    """The model as it was: no offloaded module, no recorded change, every tensor equal, plain and contiguous."""
    assert not any(isinstance(m, OffloadedExperts) for m in model.modules())
    assert [str(c) for c in tnn.report(model)] == list(report)
    _assert_state(model, before)
    for n, p in model.named_parameters():
        assert p.is_meta or p.is_contiguous(), f"{n} is not contiguous"


def _empty_experts(model, layers):
    """Experts that exist nowhere in memory (a model built empty): parameters on the meta device."""
    for layer in layers:
        module = _experts(model)[layer]
        for n, p in list(module._parameters.items()):
            module._parameters[n] = torch.nn.Parameter(torch.empty_like(p, device="meta"))
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The checkpoint of ``_model()`` as saved before any fine-tuning."""
    path = tmp_path_factory.mktemp("saved")
    _model().save_pretrained(path)
    return path


RULE = [
    {
        "match": {"kernel": "moe"},
        "replace": {
            "class": "tritonspec.nn.offload.OffloadedExperts",
            "kwargs": {"experts_per_layer": 8, "cpu_compute": False},
        },
    }
]


def _rule(**kwargs):
    rule = copy.deepcopy(RULE)
    rule[0]["replace"]["kwargs"].update(kwargs)
    return rule


# --------------------------------------------------------------------------------------------------
# the model's own weights are served, saved and given back
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_a_fine_tuned_model_is_served_its_own_experts_and_gets_them_back(storage, saved):
    model = _fine_tune(_model())
    before, want = _snapshot(model), _logits(model)
    assert not torch.allclose(_logits(_model()), want, atol=1e-2)  # the checkpoint's experts would show
    handle = offload_experts(model, experts_per_layer=3, storage=storage, checkpoint=saved, cpu_compute=False)
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    if storage == "disk":  # exactly the tuned experts are kept apart from the checkpoint
        assert [sorted(m.store.owned) for _, m in handle.layers] == [sorted(TUNED.get(i, ())) for i in range(3)]
    _assert_state(model, before)  # state_dict() of the offloaded model: every expert, the model's
    handle.revert()
    _assert_as_before(model, before)
    assert torch.equal(_logits(model), want)


def test_only_experts_on_the_meta_device_come_from_the_checkpoint(saved):
    model = _empty_experts(_fine_tune(_model(), {1: (0, 3)}), layers=[0])
    want = _experts(_model())[0]  # the checkpoint's layer 0; layers 1 and 2 are the model's own
    tuned = {n: p.detach().clone() for n, p in _experts(model)[1].named_parameters()}
    offload_experts(model, experts_per_layer=8, storage="cpu", checkpoint=saved, cpu_compute=False)
    sd = model.state_dict()
    assert torch.equal(sd["model.layers.0.mlp.experts.gate_up_proj"], want.gate_up_proj)
    assert torch.equal(sd["model.layers.0.mlp.experts.down_proj"], want.down_proj)
    assert torch.equal(sd["model.layers.1.mlp.experts.gate_up_proj"], tuned["gate_up_proj"])
    assert torch.equal(sd["model.layers.1.mlp.experts.down_proj"], tuned["down_proj"])
    reference = _fine_tune(_model(), {1: (0, 3)})
    assert torch.allclose(_logits(model), _logits(reference), rtol=1e-5, atol=1e-6)
    tnn.revert(model)
    assert _experts(model)[0].gate_up_proj.is_meta and torch.equal(_experts(model)[1].down_proj, tuned["down_proj"])


def test_a_bfloat16_checkpoint_serves_a_float32_model_holding_its_values(tmp_path):
    """Compared after the same conversion: float32 weights that are bfloat16 values are the checkpoint's."""
    _model(torch.bfloat16).save_pretrained(tmp_path)
    model = _model(torch.bfloat16).float()
    before, want = _snapshot(model), _logits(model)
    handle = offload_experts(model, experts_per_layer=8, storage="disk", checkpoint=tmp_path, cpu_compute=False)
    assert all(not m.store.owned for _, m in handle.layers)
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    handle.revert()
    _assert_as_before(model, before)


# --------------------------------------------------------------------------------------------------
# all or nothing: a failure part-way leaves the model as it was
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def shallow(tmp_path_factory):
    """A checkpoint of the same model with only its first two layers: layer 2's experts are missing."""
    path = tmp_path_factory.mktemp("shallow")
    model = _model()
    model.model.layers = model.model.layers[:2]
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_a_rule_file_failing_at_the_last_layer_restores_the_earlier_ones(storage, shallow):
    model = _fine_tune(_model())
    if storage == "cpu":  # the host tier reads only experts that exist nowhere in memory
        _empty_experts(model, layers=[2])
    before = _snapshot(model)
    with pytest.raises(tnn.RuleError, match=r"model\.layers\.2\.mlp\.experts.*no tensors for expert 0"):
        tnn.apply_rules(model, _rule(storage=storage, checkpoint=str(shallow)))
    _assert_as_before(model, before)


def test_offload_experts_checks_every_layer_before_the_first_changes(shallow):
    model = _fine_tune(_model())
    before = _snapshot(model)
    with pytest.raises(
        ValueError,
        match=rf"no tensors for expert 0 of model\.layers\.2\.mlp\.experts in "
        rf"{re.escape(str(shallow))}",
    ):
        offload_experts(model, experts_per_layer=2, storage="disk", checkpoint=shallow)
    _assert_as_before(model, before)


# --------------------------------------------------------------------------------------------------
# checkpoints of another model: shapes and dtypes checked before anything changes
# --------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def narrower(tmp_path_factory):
    """A checkpoint of a model whose experts are half as wide."""
    path = tmp_path_factory.mktemp("narrower")
    _model(moe_intermediate_size=8).save_pretrained(path)
    return path


@pytest.mark.parametrize("storage,meta", [("disk", False), ("cpu", True)])
def test_a_checkpoint_of_other_shapes_is_refused(storage, meta, narrower):
    model = _model()
    if meta:
        _empty_experts(model, layers=[0, 1, 2])
    before = _snapshot(model)
    file = re.escape(str(narrower / "model.safetensors"))
    with pytest.raises(
        ValueError,
        match=rf"{file}: model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has shape "
        r"\[8, 32\], but model\.layers\.0\.mlp\.experts\.gate_up_proj of the model "
        r"needs \[16, 32\]",
    ):
        offload_experts(model, experts_per_layer=2, storage=storage, checkpoint=narrower)
    _assert_as_before(model, before)
    with pytest.raises(tnn.RuleError, match="has shape"):
        tnn.apply_rules(model, _rule(storage=storage, checkpoint=str(narrower)))
    _assert_as_before(model, before)


def _rewrite(saved, out, edit):
    """A copy of ``saved`` whose model.safetensors is ``edit(header, data)`` (bytes)."""
    raw = (saved / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    out.mkdir()
    (out / "config.json").write_bytes((saved / "config.json").read_bytes())
    (out / "model.safetensors").write_bytes(edit(json.loads(raw[8 : 8 + n]), raw[8 + n :]))
    return out


def _pack(header, data=b""):
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _retype(header, data):
    """The first expert's gate weight stored as int8 (of the right size)."""
    key = "model.layers.0.mlp.experts.0.gate_proj.weight"
    entries = sorted(((k, v) for k, v in header.items() if k != "__metadata__"), key=lambda kv: kv[1]["data_offsets"])
    out, at = bytearray(), 0
    for k, v in entries:
        begin, end = v["data_offsets"]
        chunk = data[begin:end] if k != key else bytes((end - begin) // 4)
        v["data_offsets"] = [at, at + len(chunk)]
        if k == key:
            v["dtype"] = "I8"
        out += chunk
        at += len(chunk)
    return _pack(header, bytes(out))


def test_a_checkpoint_of_another_dtype_is_refused(saved, tmp_path):
    path = _rewrite(saved, tmp_path / "int8", _retype)
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts\.0\.gate_proj\.weight has dtype I8"):
        offload_experts(model, experts_per_layer=2, storage="disk", checkpoint=path)
    _assert_as_before(model, before)


# --------------------------------------------------------------------------------------------------
# hostile checkpoints: parsed by safetensors' rules, every path inside the folder, errors name the file
# --------------------------------------------------------------------------------------------------
_FIRST = "model.layers.0.mlp.experts.0.down_proj.weight"  # the first tensor's offsets in the data


def _shift(header, by):
    for k, v in header.items():
        if k != "__metadata__":
            v["data_offsets"] = [o + by for o in v["data_offsets"]]
    return header


def _by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _set(header, field, value):
    """``field`` of the tensor whose data comes first set to ``value``."""
    header[_by_offset(header)[0]][field] = value
    return header


def _overlap(header):
    """The second tensor's data placed on the first's."""
    first, second = _by_offset(header)[:2]
    header[second]["data_offsets"] = list(header[first]["data_offsets"])
    return header


def _duplicate(header):
    """The header's JSON with one key twice (the second copy's data elsewhere)."""
    again = dict(header[_FIRST], data_offsets=[1, 2])
    return (
        json.dumps(header).encode()[:-1]
        + b", "
        + json.dumps(_FIRST).encode()
        + b": "
        + json.dumps(again).encode()
        + b"}"
    )


HOSTILE = {
    "negative offsets": (lambda h, d: _pack(_shift(h, -8), d), "data_offsets must be two non-negative ints"),
    "shifted offsets": (lambda h, d: _pack(_shift(h, 16), d), r"do not start where the previous tensor ends \(0\)"),
    "overlapping offsets": (lambda h, d: _pack(_overlap(h), d), "do not start where the previous tensor ends"),
    "truncated": (lambda h, d: _pack(h, d[: len(d) // 2]), "truncated"),
    "trailing bytes": (lambda h, d: _pack(h, d + bytes(16)), "trailing bytes"),
    "huge header length": (lambda h, d: (2**62).to_bytes(8, "little") + b"{}", "exceeds safetensors' limit"),
    "header past the end": (lambda h, d: (10**6).to_bytes(8, "little") + b"{}", "runs past the end of the file"),
    "shorter than a length": (lambda h, d: b"\x01\x02\x03", "less than the 8-byte header length"),
    "not JSON": (lambda h, d: _pack(b"{'weights': 1"), "the header is not valid JSON"),
    "deeply nested JSON": (lambda h, d: _pack(b"[" * 100_000 + b"]" * 100_000), "the header is not valid JSON"),
    "JSON list": (lambda h, d: _pack(b"[1, 2]"), "the header is a JSON list, not an object"),
    "not UTF-8": (lambda h, d: _pack(b'{"\xff": 1}'), "the header is not UTF-8"),
    "duplicate key": (lambda h, d: _pack(_duplicate(h), d), "duplicate key"),
    "unknown dtype": (lambda h, d: _pack(_set(h, "dtype", "F33"), d), "unknown dtype 'F33'"),
    "size against shape": (lambda h, d: _pack(_set(h, "shape", [3, 3]), d), "needs 36"),
    "float shape": (lambda h, d: _pack(_set(h, "shape", [32.0, 16]), d), "shape must be a list of non-neg"),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_malformed_safetensors_file_is_refused_by_name(case, saved, tmp_path):
    edit, problem = HOSTILE[case]
    path = _rewrite(saved, tmp_path / "hostile", edit)
    file = path / "model.safetensors"
    with pytest.raises(safetensors.SafetensorError):  # the safetensors library refuses it too: the same rules
        safetensors.safe_open(str(file), framework="pt")
    model = _fine_tune(_model())
    before = _snapshot(model)
    for storage in ("disk", "cpu"):
        with pytest.raises(ValueError, match=rf"checkpoint: {re.escape(str(file))}.*{problem}"):
            offload_experts(model, experts_per_layer=2, storage=storage, checkpoint=path)
        _assert_as_before(model, before)


def test_what_safetensors_accepts_is_accepted(saved, tmp_path):
    """Metadata, an empty tensor and a header padded with spaces (as safetensors' writer pads it) are fine."""

    def edit(header, data):
        header["__metadata__"] = {"format": "pt", "note": "padded"}
        header["empty"] = {"dtype": "F32", "shape": [0, 4], "data_offsets": [0, 0]}
        return _pack(json.dumps(header).encode() + b" " * 7, data)

    path = _rewrite(saved, tmp_path / "padded", edit)
    with safetensors.safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert "empty" in f.keys()
    model = _model()
    want = _logits(model)
    handle = offload_experts(model, experts_per_layer=8, storage="disk", checkpoint=path, cpu_compute=False)
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    handle.revert()


def _indexed(saved, folder, weight_map=None, text=None, shard="model-00001-of-00001.safetensors"):
    """``saved`` as a sharded checkpoint: its file renamed ``shard`` and an index (``weight_map`` or raw ``text``)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_bytes((saved / "config.json").read_bytes())
    (folder / shard).write_bytes((saved / "model.safetensors").read_bytes())
    if text is None:
        with safetensors.safe_open(str(saved / "model.safetensors"), framework="pt") as f:
            weight_map = weight_map or {k: shard for k in f.keys()}
        text = json.dumps({"metadata": {}, "weight_map": weight_map})
    (folder / "model.safetensors.index.json").write_text(text)
    return folder


def _all_in(saved, name):
    with safetensors.safe_open(str(saved / "model.safetensors"), framework="pt") as f:
        return {k: name for k in f.keys()}


@pytest.mark.parametrize(
    "case", ["parent", "absolute", "no weight_map", "not JSON", "not a name", "missing shard", "wrong shard"]
)
def test_an_index_is_trusted_for_nothing(case, saved, tmp_path):
    outside = tmp_path / "other" / "model.safetensors"  # a valid file outside the checkpoint folder
    outside.parent.mkdir()
    outside.write_bytes((saved / "model.safetensors").read_bytes())
    folder = tmp_path / "ckpt"
    index = re.escape(str(folder / "model.safetensors.index.json"))
    if case == "parent":
        _indexed(saved, folder, _all_in(saved, "../other/model.safetensors"))
        problem = rf"{index} names shard '\.\./other/model\.safetensors'; shards must be relative paths inside"
    elif case == "absolute":
        _indexed(saved, folder, _all_in(saved, str(outside)))
        problem = rf"{index} names shard '{re.escape(str(outside))}'; shards must be relative paths inside"
    elif case == "no weight_map":
        _indexed(saved, folder, text=json.dumps({"metadata": {}}))
        problem = rf"{index} has no weight_map object"
    elif case == "not JSON":
        _indexed(saved, folder, text='{"weight_map": ')
        problem = rf"{index}: the index is not valid JSON"
    elif case == "not a name":
        _indexed(saved, folder, text=json.dumps({"weight_map": {"a": ["x"]}}))
        problem = rf"{index} names shard \['x'\]; shards are file names"
    elif case == "missing shard":
        _indexed(saved, folder, _all_in(saved, "model-00002-of-00002.safetensors"))
        problem = rf"shard {re.escape(str(folder / 'model-00002-of-00002.safetensors'))} named by {index} does not"
    else:
        weight_map = _all_in(saved, "model-00001-of-00001.safetensors")
        (folder / "extra").mkdir(parents=True, exist_ok=True)
        (folder / "extra" / "b.safetensors").write_bytes(
            _pack({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
        )
        weight_map["x"] = "extra/b.safetensors"
        weight_map[_FIRST] = "extra/b.safetensors"
        _indexed(saved, folder, weight_map)
        problem = rf"{index} places tensor '{re.escape(_FIRST)}' in extra/b\.safetensors, but .* does"
    model = _model()
    before = _snapshot(model)
    with pytest.raises((ValueError, FileNotFoundError), match=problem):
        offload_experts(model, experts_per_layer=2, storage="disk", checkpoint=folder)
    _assert_as_before(model, before)


def test_a_sharded_checkpoint_inside_its_folder_works(saved, tmp_path):
    folder = tmp_path / "ckpt"
    (folder / "shards").mkdir(parents=True)
    _indexed(saved, folder, _all_in(saved, "shards/a.safetensors"), shard="shards/a.safetensors")
    model = _model()
    want = _logits(model)
    handle = offload_experts(model, experts_per_layer=8, storage="disk", checkpoint=folder, cpu_compute=False)
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    handle.revert()


# --------------------------------------------------------------------------------------------------
# a checkpoint changing under a running model: an error naming it, never a signal
# --------------------------------------------------------------------------------------------------
_RUNNING = textwrap.dedent("""
    import os, sys
    import torch
    sys.path.insert(0, {tests!r})
    from helpers import build_model, token_ids
    from tritonspec.nn.offload import offload_experts
    model = build_model("qwen3_moe", torch.float32, seed=1, moe={moe!r}, **{sizes!r}).eval()
    model.save_pretrained({ckpt!r})
    handle = offload_experts(model, experts_per_layer=1, storage="disk", checkpoint={ckpt!r}, cpu_compute=False,
                             prefetch=False)
    ids = token_ids(96, batch=1, seq=4)
    with torch.no_grad():
        model(input_ids=ids)
    file = os.path.join({ckpt!r}, "model.safetensors")
    st = os.stat(file)
    {change}
    try:
        with torch.no_grad():
            model(input_ids=ids)
        print("forward: no error")
    except RuntimeError as e:
        print("forward:", e)
    try:
        handle.revert()
        print("revert: no error")
    except RuntimeError as e:
        print("revert:", e)
""")
CHANGES = {
    "truncated": ("os.truncate(file, st.st_size // 2)", r"size \d+ -> \d+"),
    "rewritten in place": (
        "with open(file, 'r+b') as f: f.seek(st.st_size - 64); f.write(bytes(64))\n"
        "os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))",
        r"mtime_ns \d+ -> \d+",
    ),
}


@pytest.mark.parametrize("case", list(CHANGES))
def test_a_checkpoint_changed_under_a_running_model_is_an_error_not_a_signal(case, tmp_path):
    change, what = CHANGES[case]
    script = _RUNNING.format(
        tests=os.path.dirname(os.path.abspath(__file__)), moe=MOE, sizes=SIZES, ckpt=str(tmp_path), change=change
    )
    env = dict(os.environ, TRITON_INTERPRET="1")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert run.returncode == 0, f"the process died ({run.returncode}):\n{run.stdout}\n{run.stderr[-3000:]}"
    file = re.escape(str(tmp_path / "model.safetensors"))
    for step in ("forward", "revert"):
        assert re.search(rf"^{step}: .*checkpoint: {file} changed since it was opened \(.*{what}", run.stdout, re.M), (
            run.stdout
        )


# --------------------------------------------------------------------------------------------------
# saving and loading an offloaded model
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_save_pretrained_of_an_offloaded_model_writes_its_experts(storage, saved, tmp_path):
    model = _fine_tune(_model())
    before = _snapshot(model)
    handle = offload_experts(model, experts_per_layer=2, storage=storage, checkpoint=saved)
    model.save_pretrained(tmp_path / "offloaded")
    again = type(model).from_pretrained(tmp_path / "offloaded", dtype=torch.float32)
    _assert_state(again, before)
    handle.revert()
    model.save_pretrained(tmp_path / "reverted")  # plain contiguous tensors again
    _assert_state(type(model).from_pretrained(tmp_path / "reverted", dtype=torch.float32), before)


def test_load_state_dict_updates_the_host_tier_and_the_disk_tier_refuses(saved):
    tuned = _fine_tune(_model())
    want, new = _logits(tuned), tuned.state_dict()
    model = _model()
    handle = offload_experts(model, experts_per_layer=3, storage="cpu", cpu_compute=False)
    _logits(model)  # the slots hold the old experts now
    model.load_state_dict(new)
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    handle.revert()
    _assert_as_before(model, {k: v.clone() for k, v in new.items()})
    disk = _model()
    before = _snapshot(disk)
    offload_experts(disk, experts_per_layer=3, storage="disk", checkpoint=saved)
    with pytest.raises(RuntimeError, match=r"model\.layers\.0\.mlp\.experts: its experts are offloaded to disk"):
        disk.load_state_dict(new)
    _assert_state(disk, before)


# --------------------------------------------------------------------------------------------------
# copies: deepcopy works completely, pickling is refused
# --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("storage", ["cpu", "disk"])
def test_a_deep_copy_is_independent_and_reverts_to_its_own_weights(storage, saved):
    model = _fine_tune(_model())
    before = _snapshot(model)
    offload_experts(model, experts_per_layer=2, storage=storage, checkpoint=saved, cpu_compute=False)
    want = _logits(model)  # every layer ran: the slots are filled, the layer order learned
    clone = copy.deepcopy(model)
    for mine, theirs in zip(offload_handle(model).layers, offload_handle(clone).layers):
        mine, theirs = mine[1], theirs[1]
        assert mine._device is not None and "_slots" in vars(mine)
        assert theirs._device is None and theirs._next is None and "_slots" not in vars(theirs)
        if storage == "cpu":
            for n, t in theirs.store.parts.items():
                assert t.data_ptr() != mine.store.parts[n].data_ptr()
                assert theirs.original._parameters[n].data_ptr() == t.data_ptr()  # the copy's original: its store
        else:
            assert theirs.store.sources.checkpoint is mine.store.sources.checkpoint  # read-only: shared
    # (a cache in another state groups the experts into other waves: rounding, not bits, may differ)
    assert torch.allclose(_logits(clone), want, rtol=1e-5, atol=1e-6)
    offload_handle(clone).revert()
    _assert_as_before(clone, before)
    _assert_state(model, before)  # the original is untouched and still offloaded
    assert torch.allclose(_logits(model), want, rtol=1e-5, atol=1e-6)
    offload_handle(model).revert()
    _assert_as_before(model, before)


def test_pickling_an_offloaded_model_is_refused_clearly():
    model = _model()
    before = _snapshot(model)
    handle = offload_experts(model, experts_per_layer=2, storage="cpu")
    with pytest.raises(
        TypeError,
        match=r"model\.layers\.0\.mlp\.experts: a model with offloaded experts cannot be "
        r"pickled .*state_dict\(\)",
    ):
        pickle.dumps(handle.layers[0][1])
    for save in (pickle.dumps, lambda m: torch.save(m, io.BytesIO())):  # the module's or the engine's refusal
        with pytest.raises(TypeError, match=r"cannot (be )?pickle.*state_dict\(\)"):
            save(model)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)  # what the error suggests works, with every expert
    buf.seek(0)
    _assert_state(model, before)
    loaded = torch.load(buf)
    assert loaded.keys() == before.keys() and all(torch.equal(loaded[k], before[k]) for k in before)


# --------------------------------------------------------------------------------------------------
# expert-parallel models, handles after revert, devices
# --------------------------------------------------------------------------------------------------
@pytest.fixture
def one_rank_mesh():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group already exists in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("ep",))
    finally:
        dist.destroy_process_group()


def test_an_expert_parallel_model_is_refused_before_any_change(one_rank_mesh):
    from tritonspec.distributed import expert_parallel

    model = _model()
    expert_parallel(model, one_rank_mesh)
    before, report = _snapshot(model), [str(c) for c in tnn.report(model)]
    with pytest.raises(
        ValueError,
        match=r"model\.layers\.0\.mlp\.experts: its experts are sharded by "
        r"tritonspec\.distributed\.expert_parallel",
    ):
        offload_experts(model, experts_per_layer=2)
    _assert_as_before(model, before, report)
    with pytest.raises(tnn.RuleError, match="expert_parallel"):
        tnn.apply_rules(model, RULE)
    _assert_as_before(model, before, report)


def test_a_handle_after_revert_says_so():
    model = _model()
    handle = offload_experts(model, experts_per_layer=2)
    stale = offload_handle(model)
    handle.revert()
    for h in (handle, stale):
        with pytest.raises(RuntimeError, match=r"offload handle: stats\(\) after the offload was reverted"):
            h.stats()
        with pytest.raises(RuntimeError, match="reset_stats"):
            h.reset_stats()
    stale.revert()  # nothing left to do


@pytest.mark.parametrize(
    "device,match",
    [
        ("cuda", "device: 'cuda' asks for CUDA, but"),
        ("cuda:7", "device: 'cuda:7'"),
        ("tpu", "device: expected a device such as"),
        ("meta", "device: offloaded experts run on 'cpu' or 'cuda', got 'meta'"),
    ],
)
def test_the_device_is_checked_first(device, match):
    if torch.cuda.is_available() and device != "meta" and device != "tpu":
        pytest.skip("this machine has CUDA")
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=re.escape(match) if "such as" not in match else match):
        offload_experts(model, experts_per_layer=2, device=device)
    _assert_as_before(model, before)
    handle = offload_experts(model, experts_per_layer=2, device="cpu")  # a retry finds the model as it was
    handle.revert()
    _assert_as_before(model, before)


def test_a_failed_move_to_the_device_undoes_the_offload(monkeypatch):
    model = _model()
    before = _snapshot(model)

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory (simulated)")

    monkeypatch.setattr(model, "to", fail)
    with pytest.raises(RuntimeError, match="simulated"):
        offload_experts(model, experts_per_layer=2, device="cpu")
    monkeypatch.undo()
    _assert_as_before(model, before)
