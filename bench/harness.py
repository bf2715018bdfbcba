"""What the benchmarks share: the timers, launch-config overrides for their sweeps, and the models' shapes (real,
and tiny for ``--smoke`` runs on the CPU interpreter)."""

from __future__ import annotations

import contextlib
import time

# Whole models at their real shapes (Hugging Face config.json): transformers config class and its fields.
MODEL_SHAPES = {
    "qwen3-30b-a3b": (
        "Qwen3MoeConfig",
        dict(
            hidden_size=2048,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            moe_intermediate_size=768,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            vocab_size=151936,
            intermediate_size=6144,
            mlp_only_layers=[],
            decoder_sparse_step=1,
        ),
    ),
    "mixtral-8x7b": (
        "MixtralConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            num_local_experts=8,
            num_experts_per_tok=2,
            vocab_size=32000,
        ),
    ),
    "llama-3-8b": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            vocab_size=128256,
            rope_theta=500000.0,
        ),
    ),
}


# What --smoke puts in place of MODEL_SHAPES' sizes, per field a model has (each model keeps its other fields)
SMOKE_SIZES = dict(
    hidden_size=64,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    intermediate_size=64,
    num_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=128,
)


def model_config(name: str, *, layers: int | None = None, smoke: bool = False):
    """transformers' config of ``MODEL_SHAPES[name]``: SMOKE_SIZES where ``smoke``, ``layers`` decoder layers where
    given."""
    import transformers

    config_class, sizes = MODEL_SHAPES[name]
    if smoke:
        sizes = {k: SMOKE_SIZES.get(k, v) for k, v in sizes.items()}
    if layers:
        sizes = dict(sizes, num_hidden_layers=layers)
    return getattr(transformers, config_class)(**sizes)


def log(*a):
    print("#", *a, flush=True)


def sync(device) -> None:
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device):
    """(seconds, result) of ``fn()``, ``device`` synchronized before and after."""
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return time.perf_counter() - t0, out


@contextlib.contextmanager
def override(module, cfg):
    """Every kernel named in ``cfg`` gets those fields on top of what the backend chose (its table, else the
    op's default): ``module`` (an op module) asks this version of ``launch_config``."""
    orig = module.launch_config

    def launch_config(config, device, default, **problem):
        return orig(config, device, default, **problem).override(cfg.get(config.kernel, {}))

    module.launch_config = launch_config
    try:
        yield
    finally:
        module.launch_config = orig


def quantiles(fn, *, smoke: bool, warmup: int = 25, rep: int = 100, grad_to_none=None) -> tuple[float, float, float]:
    """(median, p20, p80) ms of ``fn`` by ``triton.testing.do_bench``; ``smoke`` (CPU interpreter runs that
    check a script): one warm call, then one wall-clock call."""
    if smoke:
        fn()
        t = time.perf_counter()
        fn()
        ms = (time.perf_counter() - t) * 1e3
        return ms, ms, ms
    import triton

    return tuple(
        triton.testing.do_bench(fn, warmup=warmup, rep=rep, grad_to_none=grad_to_none, quantiles=[0.5, 0.2, 0.8])
    )


def emit(table: str, path: str | None) -> None:
    """Print a result table and, given a path, write it there."""
    print(table)
    if path:
        with open(path, "w") as f:
            f.write(table)
