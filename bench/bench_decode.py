"""Greedy decode of whole models at real shapes, random weights, bf16 on one GPU: transformers against ours.

    python bench/bench_decode.py [--case qwen3-30b-a3b|mixtral-8x7b|llama-3-8b|all] [--batch 1,8] [--prompt 64,2048]
                                 [--new 256] [--variants hf-eager,hf-graphs,ts-eager,ts-graphs,...] [--out FILE.md]
                                 [--gpu-budget 16GiB] [--link 54e9] [--routing model|zipf] [--zipf-s 1.0]

Variants:
- ``hf-eager``: transformers' model as it is (SDPA, its experts implementation), dynamic cache.
- ``hf-graphs``: ``cache_implementation="static"`` with transformers' own compile path (its ``CompileConfig``:
  Inductor, ``mode="reduce-overhead"``, so CUDA graphs), ``fullgraph=True``.
- ``ts-eager``: ``kernelize(model, mode=Mode.INFERENCE)`` plus ``attn_implementation="tritonspec"``, dynamic cache.
- ``ts-graphs``: the same model under the same static cache and compile path as ``hf-graphs``.
- ``hf-decoder`` / ``ts-decoder``: transformers' model / ours, decoded by ``tritonspec.nn.GraphDecoder`` (one
  Inductor-compiled step captured in one CUDA graph, replayed per token; no guard check or host sync per token).
- ``ts-offload``: ``ts-decoder`` with the experts in host memory: ``offload_experts(model, gpu_budget=...)``
  (``--gpu-budget``: GPU expert slots of all layers together; ``--smoke``: 2 slots per layer), then
  ``GraphDecoder``. MoE models only. Its rows add the hit rate (routed experts served from a slot, of all served:
  slots, copies, CPU, read in place from host memory) and the bytes per token over the host link (copied plus
  read in place): the counters of generate(new) less those of generate(1), as tok/s is taken. The link bound is
  ``--link`` (H100: 54 GB/s pinned) over those bytes. ``--case mixtral-8x7b`` without ``--layers``: its 90 GB of
  experts do not fit the GPU, so they are built in host memory (the rest on the GPU) and only ``ts-offload`` runs.
Each row's model is the same: ours is kernelized (and offloaded) for its rows and reverted after (weights
untouched).

Weights: normal(0, 0.02), norms 1, the LM head 10x wider (greedy choices then have a margin above bf16 rounding,
so the tokens of different implementations can be compared: the last column, against the first variant's); each
router's rows are rescaled to norm 4 (logits of std ~4 after the norm layer).
Routing (``--routing``): ``model`` is the random router's own, which at real shapes is nearly degenerate (the
residual streams of a random model's tokens barely differ: H100, Qwen3-30B-A3B, 99 % of a 2048-token prefill's
picks fall on each layer's top quarter of experts), so an offloaded model finds almost every expert resident.
``zipf`` routes by a known law instead, as a benchmark of offloading needs: each token draws its ``k`` experts
without replacement from Zipf(``--zipf-s``) over an expert order shuffled per layer (Gumbel top-k: ``-s log rank``
plus Gumbel noise hashed from the token's hidden state, so the draw is deterministic, traceable and the same in
every variant; s = 0 is uniform). A forward hook on each router replaces its ids (its weights: its own softmax
at those ids, renormalized where ``norm_topk_prob``), so eager, kernelized, compiled, captured and offloaded
variants all route alike, as long as they compute the same bits: the noise hashes the hidden state's last bits,
so a variant that rounds differently anywhere (the offload's prefill sums its waves of experts in fp32) routes
its next layers otherwise, and its tokens part from the others' (H100, Mixtral-8x7B cut to 8 layers: every
token; each layer's experts alone are as close to float64 as the GPU's). The header gives the share of a
prefill's picks on each layer's top quarter.
Timing, per (batch, prompt), after a warm-up generate of both lengths below (compiles, CUDA-graph recordings):
time to first token = ``generate(max_new_tokens=1)``; decode tok/s = batch * (new - 1) / (t(new) - t(1)).
Bytes per step: every weight a step reads (the LM head; for MoE layers only the experts the batch routes to,
expected distinct experts under uniform routing), plus the KV cache read at the step's mean
context; the bound is HBM bandwidth (``--hbm``, H100: 3.0 TB/s) over those bytes. Peak GiB:
``max_memory_allocated`` during the rows.

``--smoke`` runs tiny models on the CPU interpreter (no graphs there: the static rows run eagerly).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import gc
import os
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import transformers  # noqa: E402

from harness import log, model_config, timed  # noqa: E402  bench/harness.py: this script's directory is on sys.path
from tritonspec.nn import GraphDecoder, Mode, kernelize, revert  # noqa: E402
from tritonspec.nn.attention import use_tritonspec_attention  # noqa: E402
from tritonspec.nn.detectors import is_fused_experts, is_topk_router  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float32 if SMOKE else torch.bfloat16
GiB = 2**30

CASES = ("qwen3-30b-a3b", "llama-3-8b")  # of harness.MODEL_SHAPES: --case all
# Cases whose experts do not fit one GPU (Mixtral: 90 GB): by name only. Whole, their experts are built in host
# memory and only ts-offload runs; with --layers (8: 23 GB of experts) they are built on the GPU as the others.
WHOLE_TOO_BIG = ("mixtral-8x7b",)
VARIANTS = ("hf-eager", "hf-graphs", "ts-eager", "ts-graphs", "hf-decoder", "ts-decoder", "ts-offload")
SMOKE_SLOTS = 2  # ts-offload's slots per layer in --smoke (of 8 experts, top-2), in place of --gpu-budget
SKEW_TOKENS = 256 if SMOKE else 2048  # the prefill whose routing the header describes
COUNTERS = ("hits", "misses", "cpu_experts", "mapped", "bytes_to_device", "bytes_mapped")  # of the offload's stats


def build(case, layers, routing="model", zipf_s=1.0, experts_on_host=False):
    """The model, and the hooks of ``routing`` on it (to remove after the case). ``experts_on_host``: the fused
    experts' weights in host memory, the rest on the GPU (a model only ts-offload can run)."""
    cfg = model_config(case, layers=layers, smoke=SMOKE)
    if experts_on_host:
        model = _experts_on_host(cfg)
    else:
        with torch.device(DEV):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=DT)
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g, dtype=torch.float32).mul_(0.02).to(DT))
        model.get_output_embeddings().weight.mul_(10.0)  # greedy choices with a margin above bf16 rounding
        for m in model.modules():
            if is_topk_router(m):
                m.weight.mul_(4.0 / m.weight.float().norm(dim=1, keepdim=True).to(DT))
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, zipf_routing(model, zipf_s) if routing == "zipf" else []


def _experts_on_host(cfg):
    """The model built on the meta device, then each fused experts module's parameters in host memory on 2 MB
    pages (as the offload's host tier allocates, so it keeps them as they are: no second copy of 90 GB) and
    every other parameter on DEV. A module whose buffers are computed when it is built (the rotary embedding) is
    built again on DEV."""
    from tritonspec.nn.offload.storage import host_empty

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=DT)
    for name, m in list(model.named_modules()):
        if any(b is not None and b.is_meta for b in m._buffers.values()):
            if not type(m).__name__.endswith("RotaryEmbedding"):
                raise NotImplementedError(f"{name}: {type(m).__name__}'s buffers are computed when it is built")
            parent, _, attr = name.rpartition(".")
            with torch.device(DEV):
                setattr(model.get_submodule(parent), attr, type(m)(config=model.config))
    for m in model.modules():
        host = is_fused_experts(m)
        for n, p in list(m._parameters.items()):
            if p is not None and p.is_meta:
                t = host_empty(p.shape, p.dtype) if host else torch.empty(p.shape, dtype=p.dtype, device=DEV)
                m._parameters[n] = torch.nn.Parameter(t, requires_grad=p.requires_grad)
    model.tie_weights()
    return model


def zipf_routing(model, s):
    """A forward hook on every top-k router whose ids are a Zipf(s) draw without replacement (see the module
    docstring). A hook, not a new forward: kernelize replaces the router's forward and keeps hooks, and Dynamo
    traces hooks into compiled and captured steps."""
    g = torch.Generator().manual_seed(1)
    hooks = []
    for m in model.modules():
        if is_topk_router(m):
            n, hidden = m.weight.shape
            prefer = torch.empty(n, dtype=torch.float64)
            prefer[torch.randperm(n, generator=g)] = -s * torch.arange(1, n + 1, dtype=torch.float64).log()
            probe = torch.randn(hidden, n, generator=g, dtype=torch.float32)
            route = functools.partial(
                _zipf_route, prefer.float().to(DEV), probe.to(DEV), m.top_k, getattr(m, "norm_topk_prob", True)
            )
            hooks.append(m.register_forward_hook(route, with_kwargs=True))
    return hooks


def _zipf_route(prefer, probe, top_k, renormalize, router, args, kwargs, out):
    """The router's ``(logits, weights, ids)`` with ids drawn by Gumbel top-k over ``prefer`` (``-s log rank``):
    the Gumbel noise's uniforms are the fractional parts of the token's hidden state projected on ``probe``,
    scaled up (tokens whose states differ in the last bits draw independently)."""
    x = args[0] if args else kwargs["hidden_states"]
    x = x.reshape(-1, probe.shape[0]).float()
    u = torch.frac((x @ probe).abs() * 4096.0).clamp(1e-6, 1 - 1e-6)
    ids = torch.topk(prefer - torch.log(-torch.log(u)), top_k, dim=-1).indices
    weights = torch.softmax(out[0].float(), dim=-1).gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return out[0], weights.to(out[1].dtype), ids.to(out[2].dtype)


def routing_skew(model, tokens):
    """Share of a ``tokens``-token prefill's routed picks on each MoE layer's most-picked quarter of experts,
    averaged over layers (None without routers): what ``--routing`` does to the model's routing."""
    picks = []
    record = lambda m, a, out: picks.append((m.weight.shape[0], out[2].reshape(-1)))  # noqa: E731
    hooks = [m.register_forward_hook(record) for m in model.modules() if is_topk_router(m)]
    ids = torch.randint(0, model.config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(2))
    try:
        with torch.no_grad():
            model(ids.to(DEV), use_cache=False, logits_to_keep=1)
    finally:
        for h in hooks:
            h.remove()
    shares = []
    for n, chosen in picks:
        counts = torch.bincount(chosen.cpu(), minlength=n).sort(descending=True).values
        shares.append(counts[: max(1, n // 4)].sum().item() / counts.sum().item())
    return sum(shares) / len(shares) if shares else None


def step_bytes(model, batch, context, handle=None):
    """HBM bytes one decode step reads: weights (routed experts only: expected distinct under uniform routing;
    offloaded ones counted too, though slots or the host link serve them) and the KV cache at ``context`` keys."""
    cfg = model.config
    experts = [m for m in model.modules() if is_fused_experts(m)]
    expert_ids = {id(p) for m in experts for p in m.parameters()}
    embed = model.get_input_embeddings().weight
    dense = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in expert_ids)
    dense -= embed.numel() * embed.element_size() - batch * embed.shape[1] * embed.element_size()  # rows looked up
    if model.get_output_embeddings().weight is embed:  # tied: the head reads it all
        dense += embed.numel() * embed.element_size()
    routed = 0
    sizes = [sum(p.numel() * p.element_size() for p in m.parameters()) for m in experts]
    sizes += [m.layout.nbytes * m.num_experts for _, m in (handle.layers if handle else ())]
    for e in sizes:
        n, k = cfg.num_experts, cfg.num_experts_per_tok
        routed += e / n * n * (1 - (1 - k / n) ** batch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * DT.itemsize * context * batch
    return dense + routed + kv


def generate(model, ids, new, static, decoder=None):
    if decoder is not None:
        return decoder.generate(ids, max_new_tokens=new, eos_token_id=[])
    kw = dict(do_sample=False, min_new_tokens=new, max_new_tokens=new, attention_mask=torch.ones_like(ids))
    if static:
        cc = transformers.CompileConfig(fullgraph=True)
        cc._compile_all_devices = SMOKE or None  # the CPU: compiled too, so --smoke checks the traced path
        if SMOKE:
            cc.backend, cc.mode = "aot_eager", None
        kw.update(cache_implementation="static", compile_config=cc)
    return model.generate(ids, **kw)


def counters(handle):
    """The offload's counters now (none without one); ``mapped`` and ``bytes_mapped`` read as 0 where the
    offload does not count them."""
    if handle is None:
        return {}
    stats = handle.stats()
    get = stats.get if isinstance(stats, dict) else functools.partial(getattr, stats)
    return {k: get(k, 0) for k in COUNTERS}


def link_traffic(before, after_1, after_n, tokens):
    """(hit rate, link bytes per token) of the decode steps: generate(new)'s counters less generate(1)'s, as
    tok/s is taken, so the prompt's prefill drops out."""
    d = {k: (after_n[k] - after_1[k]) - (after_1[k] - before[k]) for k in COUNTERS}
    served = d["hits"] + d["misses"] + d["cpu_experts"] + d["mapped"]
    return d["hits"] / served if served > 0 else float("nan"), (d["bytes_to_device"] + d["bytes_mapped"]) / tokens


def measure(name, model, batch, prompt, new, static, reference, hbm, skip_guards=False, handle=None, link=None):
    decoder = None
    if name.endswith("decoder") or name == "ts-offload":  # captured by the warm-up, for this (batch, length)
        backend = "aot_eager" if SMOKE else "inductor"
        decoder = GraphDecoder(model, max_cache_len=prompt + new, batch_size=batch, compile_backend=backend)
    ids = torch.randint(0, model.config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(prompt))
    ids = ids.to(DEV)
    with torch.no_grad():
        t_warm = time.perf_counter()
        generate(model, ids, 1, static, decoder)
        out = generate(model, ids, new, static, decoder)
        log(f"{name} b={batch} p={prompt}: warm-up {time.perf_counter() - t_warm:.1f} s")
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        with torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip_guards and static):
            snaps = [counters(handle)]
            t1, _ = timed(lambda: generate(model, ids, 1, static, decoder), DEV)
            snaps.append(counters(handle))
            tn, out = timed(lambda: generate(model, ids, new, static, decoder), DEV)
            snaps.append(counters(handle))
    same = reference.get((batch, prompt))
    if same is None:
        reference[(batch, prompt)] = out
        same = "ref"
    else:
        same = "yes" if torch.equal(same, out) else f"{(same != out).sum().item()} differ"
    tok_s = batch * (new - 1) / max(tn - t1, 1e-9)
    nbytes = step_bytes(model, batch, prompt + new // 2, handle)
    bound = batch * hbm / nbytes
    peak = torch.cuda.max_memory_allocated() / GiB if DEV.type == "cuda" else float("nan")
    row = dict(
        name=name, batch=batch, prompt=prompt, tok_s=tok_s, ttft_ms=t1 * 1e3, peak=peak, gb=nbytes / 1e9,
        of_bound=tok_s / bound, same=same,
    )  # fmt: skip
    if handle is not None:
        hit, link_tok = link_traffic(*snaps, batch * (new - 1))
        row.update(hit=hit, link_gb=link_tok / 1e9, of_link=tok_s * link_tok / link)  # tok/s over link / bytes
    log(row)
    return row


def use_ours(model):
    kernelize(model, mode=Mode.INFERENCE)
    use_tritonspec_attention(model, source="bench")


def offload(model, args):
    """``offload_experts`` of ``model`` (kernelized): ``--gpu-budget`` of slots, ``SMOKE_SLOTS`` per layer in
    --smoke (the CPU's budget would be the whole model's experts)."""
    from tritonspec.nn.offload import offload_experts

    if SMOKE:
        handle = offload_experts(model, experts_per_layer=SMOKE_SLOTS)
    else:
        handle = offload_experts(model, gpu_budget=args.gpu_budget)
    stats = handle.stats()
    log(f"offloaded {stats['layers']} layers: {stats['slots_per_layer']} slots per layer of {model.config.num_experts}")
    return handle


def run_case(case, args):
    on_host = case in WHOLE_TOO_BIG and args.layers is None
    model, hooks = build(case, args.layers, args.routing, args.zipf_s, experts_on_host=on_host)
    where = f"{DEV}, experts in host memory" if on_host else f"{DEV}"
    log(f"{case}: {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters on {where}")
    skew = None if on_host else routing_skew(model, SKEW_TOKENS)  # an unkernelized forward needs one device
    if skew is not None:
        log(f"{case}: routing {args.routing}: {skew:.0%} of {SKEW_TOKENS} tokens' picks on each layer's top 25 %")
    rows, reference = [], {}
    try:
        for variant in args.variants:
            ours, static = variant.startswith("ts-"), variant.endswith("graphs")
            offloads = variant == "ts-offload"
            if offloads and not any(is_fused_experts(m) for m in model.modules()):
                log(f"{case}: {variant} skipped: no MoE experts to offload")
                continue
            handle = None
            try:
                if ours:
                    use_ours(model)
                if offloads:
                    handle = offload(model, args)
                torch._dynamo.reset()
                skip = args.skip_guards
                for batch in args.batch:
                    for prompt in args.prompt:
                        row = measure(
                            variant, model, batch, prompt, args.new, static, reference, args.hbm, skip, handle,
                            args.link,
                        )  # fmt: skip
                        rows.append((case, row))
            finally:
                if handle is not None:
                    gc.collect()  # the decoders' graphs and caches, before the experts come back
                    handle.revert()
                if ours:
                    revert(model)
                gc.collect()
    finally:
        for h in hooks:
            h.remove()
    del model
    gc.collect()
    return rows, skew


def table(rows, args, skews):
    env = f"torch {torch.__version__}, triton {triton.__version__}, transformers {transformers.__version__}"
    dev = torch.cuda.get_device_name() if DEV.type == "cuda" else "CPU interpreter (--smoke)"
    bounds = f"bound = {args.hbm / 1e12:.1f} TB/s over the bytes a step reads"
    if "ts-offload" in args.variants:
        slots = f"{SMOKE_SLOTS} slots per layer" if SMOKE else f"--gpu-budget {args.gpu_budget}"
        bounds += f"; link bound = {args.link / 1e9:.0f} GB/s over the link bytes a token moves (ts-offload: {slots})"
    routing = f"routing {args.routing}" + (f", s = {args.zipf_s:g}" if args.routing == "zipf" else "")
    shares = [f"{case} {share:.0%}" for case, share in skews.items() if share is not None]
    if shares:
        routing += f" (a {SKEW_TOKENS}-token prefill's routed picks on each MoE layer's top 25 % experts: "
        routing += f"{', '.join(shares)})"
    lines = [
        f"## Decode, {dev}, {env}, {datetime.date.today()}",
        "",
        f"bf16, greedy, {args.new} new tokens; {bounds}; {routing}",
        "",
        "| model | variant | batch | prompt | tok/s | x hf-graphs | of HBM bound | of link bound | hit % | "
        "link GB/tok | TTFT ms | GB/step | peak GiB | tokens = first row's |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = {(c, r["batch"], r["prompt"]): r["tok_s"] for c, r in rows if r["name"] == "hf-graphs"}
    for case, r in rows:
        b = base.get((case, r["batch"], r["prompt"]))
        link = f"{r['of_link']:.0%} | {r['hit'] * 100:.1f} | {r['link_gb']:.3f}" if "hit" in r else "- | - | -"
        lines.append(
            f"| {case} | {r['name']} | {r['batch']} | {r['prompt']} | {r['tok_s']:.1f} | "
            f"{r['tok_s'] / b if b else float('nan'):.2f} | {r['of_bound']:.0%} | {link} | {r['ttft_ms']:.1f} | "
            f"{r['gb']:.2f} | {r['peak']:.1f} | {r['same']} |"
        )
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="all", choices=(*CASES, *WHOLE_TOO_BIG, "all"))
    ap.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    ap.add_argument("--batch", default="1,8")
    ap.add_argument("--prompt", default="64,2048")
    ap.add_argument("--new", type=int, default=256)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--hbm", type=float, default=3.0e12, help="HBM bytes/s of the bound (H100 SXM: 3.0e12)")
    ap.add_argument("--gpu-budget", default="16GiB", help="ts-offload: GPU bytes of expert slots, all layers together")
    ap.add_argument("--link", type=float, default=54e9, help="host->GPU bytes/s, ts-offload's link bound (H100: 54e9)")
    ap.add_argument("--routing", choices=("model", "zipf"), default="model", help="MoE routing (see above)")
    ap.add_argument("--zipf-s", type=float, default=1.0, help="--routing zipf: the exponent s")
    ap.add_argument(
        "--skip-guards",
        action="store_true",
        help="time the graphs variants under torch.compiler.set_stance(skip_guard_eval_unsafe=True): Dynamo checks "
        "only the guards that tell its compiled steps apart (tens of thousands of guards a step otherwise)",
    )
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    args.batch = [int(b) for b in args.batch.split(",")]
    args.prompt = [int(p) for p in args.prompt.split(",")]
    args.variants = args.variants.split(",")
    unknown = set(args.variants) - set(VARIANTS)
    if unknown:
        ap.error(f"--variants: unknown {sorted(unknown)}; choose from {', '.join(VARIANTS)}")
    if SMOKE:
        args.new = min(args.new, 4)
        args.batch, args.prompt = sorted({min(b, 2) for b in args.batch}), sorted({min(p, 8) for p in args.prompt})
    if "ts-offload" in args.variants:
        from tritonspec.nn.offload import parse_bytes

        try:
            parse_bytes(args.gpu_budget)
        except ValueError as e:
            ap.error(f"--gpu-budget: {e}")
    cases = list(CASES) if args.case == "all" else [args.case]
    if args.case in WHOLE_TOO_BIG and args.layers is None and args.variants != ["ts-offload"]:
        ap.error(
            f"--case {args.case}: the whole model's experts do not fit one GPU, so they are built in host memory, "
            "where only ts-offload runs: pass --variants ts-offload (or --layers to cut the model)"
        )
    rows, skews = [], {}
    for case in cases:
        case_rows, skews[case] = run_case(case, args)
        rows += case_rows
    text = table(rows, args, skews)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
