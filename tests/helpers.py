"""Helpers shared by the CPU tests and the GPU tests (tests/gpu), so each lives in one place.

Fixtures that several files use (``registry``, ``gen``, ``spy``) are in conftest.py; this module holds
plain functions and constants, importable by name (``from helpers import leaf``) from any test file and
from the scripts tests run in subprocesses (they put tests/ on ``sys.path``).

Importing this module loads nothing that ``import triton`` does not: torch, transformers and tritonspec
are imported inside the helpers that need them. Subprocess scripts that check what a process loads
(test_spec_providers: no torch for a first compile, no tritonspec under TRITONSPEC_DISABLE=1) import it.
"""

import contextlib
import os
import random
import threading
import types

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

# -- compile targets --------------------------------------------------------------------------------
# One representative target per backend, compiled for offline: no such device is needed.

CUDA = GPUTarget("cuda", 90, 32)
HIP = GPUTarget("hip", "gfx942", 64)
ILUVATAR = GPUTarget("iluvatar", 90, 32)
ASCEND = GPUTarget("ascend", "Ascend910B3", 0)


def compile_for(fn, signature, constexprs=None, target=CUDA, **options):
    """Compile a plain Python function as a kernel for ``target``, offline.

    ``triton.jit`` would interpret the function in a session with TRITON_INTERPRET=1; wrapping it in a
    ``JITFunction`` here gives the compiler's IR whatever the session does. ``options`` are Triton's
    compile options (``num_stages=...``)."""
    return triton.compile(ASTSource(JITFunction(fn), signature, constexprs or {}), target=target, options=options)


# -- spec modules -----------------------------------------------------------------------------------


def make_spec(name, **exports):
    """A spec module exporting ``exports`` (``__all__`` lists them all), as a vendor package would.

    Tests that need an export outside ``__all__`` (the injector lists' functions) set ``__all__``
    afterwards."""
    mod = types.ModuleType(name)
    for k, v in exports.items():
        setattr(mod, k, v)
    mod.__all__ = list(exports)
    return mod


def set_interpreting(monkeypatch, value: bool) -> None:
    """Make tritonspec believe the Triton interpreter is (not) in use, for this test only.

    Whether it is is read once per process (``tritonspec.devices``); the CPU suite interprets, so this
    is how a test sees what a CPU without the interpreter (or a GPU process) gets."""
    import tritonspec.devices

    monkeypatch.setattr(tritonspec.devices, "_interpreting", value)


def no_interpreter(monkeypatch) -> None:
    """As if on a CPU without the interpreter: Triton cannot run on CPU tensors (see set_interpreting)."""
    set_interpreting(monkeypatch, False)


# -- random inputs ----------------------------------------------------------------------------------
# A fresh seed per run, so reruns keep exploring inputs; each use prints it (pytest shows the output of
# a failed test), and TRITONSPEC_TEST_SEED=<seed> replays that run's inputs.

SEED = int(os.environ.get("TRITONSPEC_TEST_SEED") or int.from_bytes(os.urandom(4), "little"))


def _announce(seed):
    print(f"seed {seed} (TRITONSPEC_TEST_SEED={seed} replays it)")


def generator(seed=None, device="cpu"):
    """A torch.Generator seeded with this run's SEED (or ``seed``), the seed printed."""
    import torch

    seed = SEED if seed is None else seed
    _announce(seed)
    return torch.Generator(device=device).manual_seed(seed)


def py_random(seed=None):
    """A ``random.Random`` seeded with this run's SEED (or ``seed``), the seed printed."""
    seed = SEED if seed is None else seed
    _announce(seed)
    return random.Random(seed)


# -- autograd ---------------------------------------------------------------------------------------


def run_together(work, args, timeout=600) -> None:
    """``work(arg)`` for every arg, each in a thread of its own, all starting at once; their errors re-raised."""
    start = threading.Barrier(len(args), timeout=120)
    errors = []

    def run(arg):
        try:
            start.wait()
            work(arg)
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the test's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(arg,)) for arg in args]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    assert not any(t.is_alive() for t in threads), f"threads still running after {timeout} s"
    assert not errors, errors


def leaf(t):
    """A copy of ``t`` that is a leaf requiring grad: gradients land on it, not on ``t``'s graph."""
    return t.detach().clone().requires_grad_(True)


# -- transformers models (random weights, built from config classes: nothing is downloaded) ---------

ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "mistral": ("MistralConfig", "MistralForCausalLM"),
}

# MoE causal LMs: (config class, model class, the architecture's settings: 4 experts, top-2, every layer
# sparse; DeepSeek's latent attention has as many key/value heads as query heads).
MOE_ARCHITECTURES = {
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2, head_dim=8, mlp_only_layers=[]),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        "Qwen2MoeForCausalLM",
        dict(
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            num_experts=4,
            num_experts_per_tok=2,
            mlp_only_layers=[],
        ),
    ),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=2)),
    "olmoe": ("OlmoeConfig", "OlmoeForCausalLM", dict(num_experts=4, num_experts_per_tok=2, eos_token_id=None)),
    "gpt_oss": (
        "GptOssConfig",
        "GptOssForCausalLM",
        dict(num_local_experts=4, num_experts_per_tok=2, head_dim=8, layer_types=["full_attention"]),
    ),
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            n_routed_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            first_k_dense_replace=0,
            n_group=2,
            topk_group=1,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=8,
            n_shared_experts=1,
            num_key_value_heads=4,
        ),
    ),
}

# The YAML rules a dense model's tests apply: decoder layers with the residual add fused into the post-attention
# norm, SwiGLU MLPs and RMSNorms.
RULES = r"""
- match: {kernel: add_rmsnorm}
  replace: {kernel: add_rmsnorm}
- match: {name: "\\.mlp$"}
  replace: {class: tritonspec.nn.hub.layers.SwiGLUMLP}
  recursive: false
- match: {name: "norm$", class: torch.nn.modules.module.Module}
  replace: {class: tritonspec.nn.RMSNorm}
"""


# The CPU tests' sizes: every code path of a real model, in milliseconds on the interpreter.
TINY = dict(
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=96,
    max_position_embeddings=64,
    num_hidden_layers=1,
)


def available_models(architectures=None):
    """The names in ``architectures`` (default ARCHITECTURES) that the installed transformers has."""
    import transformers

    return [
        name
        for name, (_, model_cls, *_) in (architectures or ARCHITECTURES).items()
        if hasattr(transformers, model_cls)
    ]


def model_config(name, moe=None, **sizes):
    """``name``'s config class with ``sizes`` (only those: every other field is the class's default); for MoE
    architectures ``moe`` replaces fields of the tiny expert sizes in MOE_ARCHITECTURES (real layer shapes).

    qwen3's head_dim defaults to 128 whatever the hidden size, the others' to hidden_size / heads: qwen3
    gets the others' rule unless ``head_dim`` is given, so one set of sizes fits every architecture."""
    import transformers

    if name in MOE_ARCHITECTURES:
        config_cls, _, tiny = MOE_ARCHITECTURES[name]
        return getattr(transformers, config_cls)(**{**sizes, **tiny, **(moe or {})})  # the architecture's needs win
    if name == "qwen3" and "hidden_size" in sizes and "num_attention_heads" in sizes:
        sizes.setdefault("head_dim", sizes["hidden_size"] // sizes["num_attention_heads"])
    return getattr(transformers, ARCHITECTURES[name][0])(**sizes)


def build_model(name, dtype, attn="sdpa", *, seed, device=None, init_dtype=None, moe=None, **sizes):
    """A causal LM of architecture ``name`` with random weights drawn after ``torch.manual_seed(seed)``,
    then cast to ``dtype``: the same ``seed`` gives every dtype the same weights, so a float64 run of the
    same model is the reference. ``init_dtype`` is passed to ``_from_config`` as ``dtype`` where given;
    ``device`` is where the weights are created."""
    import torch
    import transformers

    cfg = model_config(name, moe, **sizes)
    torch.manual_seed(seed)
    kwargs = {} if init_dtype is None else {"dtype": init_dtype}
    with torch.device(device) if device is not None else contextlib.nullcontext():
        model_cls = (MOE_ARCHITECTURES if name in MOE_ARCHITECTURES else ARCHITECTURES)[name][1]
        model = getattr(transformers, model_cls)._from_config(cfg, attn_implementation=attn, **kwargs)
    return model.to(dtype)


def tiny_model(name, dtype, attn="sdpa"):
    """The CPU tests' model: TINY sizes (llama with two layers, so a layer hands over to a layer)."""
    return build_model(name, dtype, attn, seed=1234, **dict(TINY, num_hidden_layers=2 if name == "llama" else 1))


def apply_front_end(front, model, rules, *, inference=False):
    """Apply one front end to ``model``: ``"registry"`` (apply_available_kernels), ``"kernelize"`` (training
    mode; ``inference``: inference mode and our attention switched on) or else the YAML ``rules``; returns the
    model's report."""
    import tritonspec.nn as tnn

    if front == "registry":
        tnn.apply_available_kernels(model)
    elif front == "kernelize":
        tnn.kernelize(model, mode=tnn.Mode.INFERENCE if inference else tnn.Mode.TRAINING)
        if inference:
            tnn.use_tritonspec_attention(model, source="test")
    else:
        tnn.apply_rules(model, rules)
    return tnn.report(model)


# Rules that name kernels (KTransformers style), so one file serves dense and MoE models.
KERNEL_RULES = "".join(
    f"- match: {{kernel: {k}}}\n  replace: {{kernel: {k}}}\n  optional: true\n"
    for k in ("add_rmsnorm", "rmsnorm", "swiglu", "moe", "moe_router")
)


def token_ids(vocab, batch=2, seq=8):
    """Fixed token ids (their own generator, seed 7): every model of a test sees the same batch."""
    import torch

    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(7))


def run_model(model, ids, call=None):
    """(logits, loss, {parameter name: grad}) of one training step on ``ids`` as labels.

    ``call`` runs the model instead of the model itself (a ``torch.compile``d wrapper). A model whose LM head
    and loss are fused returns no logits when it trains on labels; they come from a label-free call then."""
    import torch

    call = model if call is None else call
    model.zero_grad(set_to_none=True)
    out = call(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    logits = out.logits
    if logits is None:
        with torch.no_grad():
            logits = call(input_ids=ids).logits
    return logits.detach(), out.loss.detach(), grads


# A kernelized model rounds in other places than the original, not by more: its error against the
# float64 reference must stay within FACTOR times the original's, plus a floor of ULPS units of the
# dtype's eps at the reference's magnitude (for outputs the original happens to round almost exactly).
FACTOR = 2.0
ULPS = {"torch.float32": 64, "torch.bfloat16": 4}


def assert_like_reference(name, got, base, ref, dtype, factor=FACTOR):
    """``got`` (kernelized) is as close to ``ref`` (float64) as ``base`` (the original model) is."""
    import torch

    ref = ref.double()
    err_got = (got.double() - ref).abs().max().item()
    err_base = (base.double() - ref).abs().max().item()
    floor = ULPS[str(dtype)] * torch.finfo(dtype).eps * max(ref.abs().max().item(), 1e-30)
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    assert err_got <= factor * err_base + floor, (
        f"{name}: kernelized error {err_got:.3g} vs original {err_base:.3g} (allowed {factor}x + {floor:.3g})"
    )


def compare_to_original(model_name, got, base, ref, dtype):
    """run_model results: logits, loss and every gradient of ``got`` pass assert_like_reference."""
    (lg, ls, gg), (lb, lsb, gb), (lr, lsr, gr) = got, base, ref
    assert_like_reference(f"{model_name} logits", lg, lb, lr, dtype)
    assert_like_reference(f"{model_name} loss", ls, lsb, lsr, dtype)
    assert gg.keys() == gr.keys()
    for n in gr:
        assert_like_reference(f"{model_name} grad {n}", gg[n], gb[n], gr[n], dtype)
