"""Interop with the real ``kernels`` package and with transformers' own layer tags.

* Our hub layers, written out as a ``build/<variant>/<package>`` repository, load through kernels' own
  ``LocalLayerRepository`` and pass kernels' own purity validation; kernels' ``kernelize`` then runs our
  Triton ops inside a real transformers model with numerics as good as the original.
* transformers tags its layers (``RMSNorm``, ``rotary_pos_emb`` via ``_kernel_funcs``) only when it accepts
  the installed kernels version; transformers 5.23 wants >=0.18.2 and we have 0.17.2, so the tagged path is
  exercised in a subprocess that makes transformers believe kernels is acceptable before it is imported.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import compare_to_original, run_model, tiny_model, token_ids
import torch

import tritonspec.nn as tnn
from tritonspec.nn.hub import LAYER_NAMES, PACKAGE_NAME, write_layer_repo

kernels = pytest.importorskip("kernels")
transformers = pytest.importorskip("transformers")


def test_written_repository_layout(tmp_path):
    root = write_layer_repo(tmp_path / "repo", variants=("torch-universal", "torch-cuda"))
    for variant in ("torch-universal", "torch-cuda"):
        vdir = root / "build" / variant
        meta = json.loads((vdir / "metadata.json").read_text())
        assert meta["name"] == PACKAGE_NAME.replace("_", "-") and meta["python-depends"] == []
        assert (vdir / PACKAGE_NAME / "__init__.py").read_text().count("from . import layers") == 1
        src = (vdir / PACKAGE_NAME / "layers.py").read_text()
        # Kernel code must import itself relatively and only stdlib/torch at import time (kernel-requirements.md).
        imports = [ln for ln in src.splitlines() if ln.startswith(("import ", "from "))]
        assert imports == ["import importlib", "import torch", "from torch import nn"]
    with pytest.raises(ValueError, match="package_name"):
        write_layer_repo(tmp_path / "x", package_name="Bad-Name")
    with pytest.raises(ValueError, match="variants"):
        write_layer_repo(tmp_path / "x", variants=("cuda",))


@pytest.mark.parametrize(
    "layer_name, hf_class",
    [
        ("RMSNorm", "transformers.models.llama.modeling_llama.LlamaRMSNorm"),
        ("SwiGLUMLP", "transformers.models.llama.modeling_llama.LlamaMLP"),
        ("MoEExperts", "transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts"),
        ("MoERouter", "transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter"),
        ("DecoderLayer", "transformers.models.llama.modeling_llama.LlamaDecoderLayer"),
    ],
)
def test_kernels_package_loads_and_validates_our_layers(tmp_path, layer_name, hf_class):
    from kernels.layer.layer import _validate_layer
    import importlib

    mod, _, cls = hf_class.rpartition(".")
    ref_cls = getattr(importlib.import_module(mod), cls)
    root = write_layer_repo(tmp_path / "repo")
    repo = kernels.LocalLayerRepository(repo_path=root, layer_name=layer_name)
    layer = repo.load()
    _validate_layer(check_cls=ref_cls, cls=layer, repo=repo)  # raises on any purity/signature problem
    assert layer.__name__ == layer_name and layer.has_backward is True
    assert set(LAYER_NAMES) >= {layer_name}


def test_kernels_kernelize_runs_our_triton_layers(tmp_path, monkeypatch, spy):
    """Tag the Llama classes exactly as kernels' decorator would, then let kernels' kernelize do the rest."""
    from transformers.models.llama import modeling_llama as ml

    for cls, name in ((ml.LlamaRMSNorm, "RMSNorm"), (ml.LlamaMLP, "SwiGLUMLP")):
        monkeypatch.setattr(cls, "kernel_layer_name", name, raising=False)
        monkeypatch.setattr(cls, "kernel_condition", staticmethod(lambda m: True), raising=False)
    root = write_layer_repo(tmp_path / "repo")
    mapping = {
        name: {"cpu": kernels.LocalLayerRepository(repo_path=root, layer_name=name)}
        for name in ("RMSNorm", "SwiGLUMLP")
    }
    ids = token_ids(96)
    ref = run_model(tiny_model("llama", torch.float64), ids)
    base = run_model(tiny_model("llama", torch.float32), ids)
    model = tiny_model("llama", torch.float32)
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    assert model.model.norm.forward.__func__.__qualname__ == "RMSNorm.forward"
    spy.clear()
    got = run_model(model, ids)
    assert {"rms_norm", "swiglu"} <= set(spy)
    compare_to_original("llama via kernels", got, base, ref, torch.float32)


def test_our_local_repository_reads_the_same_tree(tmp_path):
    root = write_layer_repo(tmp_path / "repo")
    ours = tnn.LocalLayerRepository(repo_path=root, package_name=PACKAGE_NAME, layer_name="RotaryPosEmb").load()
    assert ours.__name__ == "RotaryPosEmb" and ours.__module__.startswith("_tritonspec_hub_")


_TAGGED = textwrap.dedent(r"""
    import json, os, sys
    import transformers.utils.import_utils as iu
    iu.is_kernels_available = lambda *a, **k: True   # transformers now tags its layers with kernels' decorators
    sys.path.insert(0, os.environ["TESTS_DIR"])
    import torch, kernels
    import tritonspec.nn as tnn
    from tritonspec.nn.hub import write_layer_repo
    from helpers import compare_to_original, run_model, tiny_model, token_ids
    from transformers.models.llama import modeling_llama as ml
    out = {"rms_tag": getattr(ml.LlamaRMSNorm, "kernel_layer_name", None),
           "rope_tag": getattr(ml.apply_rotary_pos_emb, "kernel_layer_name", None)}
    ids = token_ids(96)
    ref = run_model(tiny_model("llama", torch.float64), ids)
    base = run_model(tiny_model("llama", torch.float32), ids)

    model = tiny_model("llama", torch.float32)
    tnn.kernelize(model, mode=tnn.Mode.TRAINING)
    out["ours_paths"] = sorted({c.path.rsplit(".", 1)[-1] for c in tnn.report(model)})
    compare_to_original("tagged llama, our kernelize", run_model(model, ids), base, ref, torch.float32)
    tnn.revert(model)
    out["rope_forward_restored"] = "forward" not in vars(ml.apply_rotary_pos_emb)

    root = write_layer_repo(os.environ["REPO_DIR"])
    mapping = {"RMSNorm": {"cpu": kernels.LocalLayerRepository(repo_path=root, layer_name="RMSNorm")},
               "rotary_pos_emb": {"cpu": kernels.LocalLayerRepository(repo_path=root, layer_name="RotaryPosEmb")}}
    model = tiny_model("llama", torch.float32)
    with kernels.use_kernel_mapping(mapping, inherit_mapping=False):
        kernels.kernelize(model, mode=kernels.Mode.TRAINING, device="cpu")
    out["kernels_rope"] = ml.apply_rotary_pos_emb.forward.__func__.__qualname__
    import importlib; rope_mod = importlib.import_module("tritonspec.ops.rope")
    calls, real = [], rope_mod.rope
    rope_mod.rope = lambda *a, **k: calls.append(1) or real(*a, **k)
    compare_to_original("tagged llama, kernels.kernelize", run_model(model, ids), base, ref, torch.float32)
    out["kernels_rope_calls"] = len(calls)
    print("RESULT" + json.dumps(out))
""")


def test_transformers_tagged_layers_with_ours_and_kernels(tmp_path):
    env = dict(os.environ, TRITON_INTERPRET="1", TESTS_DIR=str(Path(__file__).parent), REPO_DIR=str(tmp_path / "r"))
    proc = subprocess.run([sys.executable, "-c", _TAGGED], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.split("RESULT", 1)[1])
    assert res["rms_tag"] == "RMSNorm" and res["rope_tag"] == "rotary_pos_emb"
    # our kernelize used the tags: the Func module transformers attached, the norms, the (inferred) MLPs
    assert {"rotary_pos_emb", "input_layernorm", "post_attention_layernorm", "norm", "mlp"} <= set(res["ours_paths"])
    assert res["rope_forward_restored"] is True
    assert res["kernels_rope"] == "RotaryPosEmb.forward" and res["kernels_rope_calls"] == 2  # one per layer
