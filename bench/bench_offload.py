"""Generate with MoE models whose experts do not all fit on the GPU: ``offload_experts`` against HF accelerate's
``device_map="auto"`` offload and (where it fits) the whole model on the GPU, in bf16 on one GPU.

    python bench/bench_offload.py [--case qwen3-30b-a3b|mixtral-8x7b] [--budget 16GiB] [--out FILE.md] [--smoke]

Models have the real layer shapes and random weights, built on the meta device: expert tensors are filled from
one repeated random block (std 0.02; filling 60-90 GB with randn is too slow), every other parameter is
normal(0, 0.02) (norms 1), so routing is the random-weight model's own. The experts start on the host;
accelerate runs first (``infer_auto_device_map`` with the non-expert bytes plus the budget on the GPU, whole
decoder layers, ``dispatch_model``), its hooks are removed (weights back where they were), then the same model
is offloaded, so host memory never holds two copies of the experts. Qwen3-30B-A3B (58 GB of experts) also runs
all on the GPU last, after ``revert``; Mixtral-8x7B (90 GB) cannot.

Rows, batch 1, greedy: decode tokens/s = (new - 1) / (generate time - one separately timed forward of the
prompt), after a warm-up generate; prefill tokens/s of one ``--prefill``-token forward (after one untimed, which
compiles the kernels for its shapes); peak GPU memory; for ours the decode's hit rate (experts served from a
slot / all routed experts; a prefetched expert counts as a hit although it was copied), prefetch recall, bytes
copied to the GPU per token and the share of decode time spent in CPU experts. Ours runs with prefetch and
the CPU cost model, prefetch without the CPU, and neither. The bound row is
``host_bw / ((1 - h) * layers * top_k * expert_bytes)`` with the pinned link of one expert row and the hit
rate h of the row without prefetch or CPU (the cache's own): what a decode whose misses all cross the link
can reach.

Also:
- routing traces: the experts each decode batch of each layer needed (recorded during the warm-up generate),
  replayed through LRU / LFU / frequency (``cache.simulate``) and the offline optimum (``cache.belady``) at
  the same slots per layer, averaged over layers; the prompt's batch opens the trace (the frequency policy
  profiles it) and is left out of the counts, not out of the state it leaves (the simulator plans waves as
  the module does). Plus a synthetic Zipf(s=1) trace per layer, 256 steps.
- host link: pinned and pageable host->device GB/s, one expert row and 64 MB, median of 10.
- our copy bandwidth: ``OffloadedExperts._load`` of many expert rows back to back, then one synchronize.
- overlap: t_copy = the copy-only row's bytes per decode step at that bandwidth; t_compute = one single-token
  forward run a second time (every expert then resident: hit rate 1); t_step = the copy-only row's decode
  step; hidden = clamp((t_copy + t_compute - t_step) / t_copy, 0, 1), the fraction of copy time the compute
  hid. Approximate: the decode step also attends to its KV cache, the single-token forward does not.
- CPU experts: host DRAM read bandwidth (sum of a 4 GB float32 tensor, all threads, best of 3) against the
  weight bytes per second of a one-token expert on the CPU (``host_compute.run_experts``, cycling through
  distinct experts so they come from DRAM, not the cache), and the module's own ``costs().cpu_stream``.

``--smoke`` runs the same code with tiny models on the CPU interpreter (the CPU stands in for the GPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import statistics
import sys
import time

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import transformers  # noqa: E402

from harness import log, model_config, sync, timed  # noqa: E402  bench/harness.py: on sys.path
from tritonspec.nn.offload import offload_experts, parse_bytes  # noqa: E402
from tritonspec.nn.offload.cache import belady, simulate  # noqa: E402
from tritonspec.nn.offload.host_compute import run_experts, torch_threads  # noqa: E402
from tritonspec.nn.detectors import is_fused_experts  # noqa: E402

DEV = torch.device("cpu" if SMOKE else "cuda")
DT = torch.float32 if SMOKE else torch.bfloat16
GiB = 2**30


# the model (its shapes: harness.MODEL_SHAPES) -> (model class, GPU budget of our slots, default --new)
CASES = {
    "qwen3-30b-a3b": ("Qwen3MoeForCausalLM", "16GiB", 32),
    "mixtral-8x7b": ("MixtralForCausalLM", "60GiB", 8),
}
SMOKE_SLOTS = 4  # slots per layer in --smoke (of 8 experts)


# ------------------------------------------------------------------------------------------------------------
# the model
# ------------------------------------------------------------------------------------------------------------
def config(case, layers):
    return model_config(case, layers=layers, smoke=SMOKE), getattr(transformers, CASES[case][0])


def build(case, layers):
    """The model on the host: built on meta, experts filled from a repeated block, the rest random (drawn on DEV)."""
    cfg, cls = config(case, layers)
    with torch.device("meta"):
        model = cls._from_config(cfg, dtype=DT)
    model.to_empty(device="cpu")
    rotary = model.model.rotary_emb  # its buffers are computed at init, not parameters: build it again
    model.model.rotary_emb = type(rotary)(config=model.config)
    block = (torch.randn(4_194_301 if not SMOKE else 997, device="cpu") * 0.02).to(DT)  # a prime: experts differ
    experts = {id(p) for m in model.modules() if is_fused_experts(m) for p in m.parameters()}
    g = torch.Generator(device=DEV).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if id(p) in experts:
                fill_repeated(p, block)
            elif p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            else:
                p.copy_(torch.randn(p.shape, device=DEV, generator=g, dtype=torch.float32).mul_(0.02).to(DT))
    model.eval()
    model.generation_config.pad_token_id = 0
    return model


def fill_repeated(p, block):
    """``p`` := ``block`` repeated (at memory speed: no random numbers per byte)."""
    flat, n = p.view(-1), block.numel()
    whole = flat.numel() // n
    if whole:
        flat[: whole * n].view(whole, n).copy_(block.expand(whole, n))
    flat[whole * n :].copy_(block[: flat.numel() - whole * n])


def expert_modules(model):
    return [m for m in model.modules() if is_fused_experts(m)]


def non_expert_bytes(model):
    experts = {id(p) for m in expert_modules(model) for p in m.parameters()}
    return sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in experts)


# ------------------------------------------------------------------------------------------------------------
# one row: decode, prefill, memory
# ------------------------------------------------------------------------------------------------------------
class DecodeStats:
    """Our counters at the first decode step (a model forward pre-hook): decode = end - this snapshot."""

    def __init__(self, model, handle):
        self.handle, self.at_decode = handle, None
        self.hook = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if self.at_decode is None and ids is not None and ids.shape[-1] == 1:
            self.at_decode = self.handle.stats()

    def decode(self):
        end = self.handle.stats()
        start = self.at_decode or {k: 0 for k in end}
        d = {
            k: end[k] - start[k]
            for k in ("hits", "misses", "cpu_experts", "bytes_to_device", "predicted", "needed_after_guess", "cpu_s")
        }
        served = d["hits"] + d["misses"] + d["cpu_experts"]
        d["hit_rate"] = d["hits"] / served if served else float("nan")
        d["prefetch_recall"] = d["predicted"] / d["needed_after_guess"] if d["needed_after_guess"] else float("nan")
        return d


def generate(model, ids, new):
    return model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, min_new_tokens=new, max_new_tokens=new
    )


def measure_row(name, model, args, new, handle=None, warmup_hook=None):
    """Decode and prefill tokens/s and peak GPU memory of ``model`` as it is now; ours adds its counters."""
    ids = torch.randint(0, model.config.vocab_size, (1, args.prompt), generator=torch.Generator().manual_seed(1))
    long = torch.randint(0, model.config.vocab_size, (1, args.prefill), generator=torch.Generator().manual_seed(2))
    ids, long = ids.to(DEV), long.to(DEV)
    with torch.no_grad():
        log(f"{name}: warm-up generate")
        hooks = warmup_hook() if warmup_hook else []
        generate(model, ids, min(new, 3) if not hooks else new)
        for h in hooks:
            h.remove()
        if DEV.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        t_prompt, _ = timed(lambda: model(ids, logits_to_keep=1), DEV)
        counters = DecodeStats(model, handle) if handle else None
        t_gen, out = timed(lambda: generate(model, ids, new), DEV)
        if counters:
            counters.hook.remove()
            decoded = counters.decode()  # before the prefill below adds its copies
        assert out.shape[1] == ids.shape[1] + new, out.shape
        log(f"{name}: generate {new} tokens {t_gen:.2f} s, prompt forward {t_prompt:.3f} s; prefill {args.prefill}")
        model(long, logits_to_keep=1)  # the first long batch compiles kernels for its shapes
        t_prefill, _ = timed(lambda: model(long, logits_to_keep=1), DEV)
    steps = new - 1
    row = dict(
        name=name,
        decode=steps / max(t_gen - t_prompt, 1e-9),
        prefill=args.prefill / t_prefill,
        step_s=(t_gen - t_prompt) / steps,
        peak=torch.cuda.max_memory_allocated() / GiB if DEV.type == "cuda" else float("nan"),
    )
    if counters:
        d = decoded
        row.update(
            hit=d["hit_rate"],
            recall=d["prefetch_recall"],
            bytes_tok=d["bytes_to_device"] / steps,
            cpu_share=d["cpu_s"] / (t_gen - t_prompt),
        )
    log(row)
    return row


def accelerate_row(model, args, budget):
    """HF accelerate's standard offload (what ``device_map="auto"`` with ``max_memory`` does), then undone."""
    if SMOKE:
        log("accelerate skipped: --smoke has no GPU for a device map")
        return None
    try:
        from accelerate import dispatch_model, infer_auto_device_map
        from accelerate.hooks import remove_hook_from_submodules
    except ImportError as e:
        log(f"accelerate skipped: {e}")
        return None
    no_split = list(getattr(model, "_no_split_modules", None) or [type(model.model.layers[0]).__name__])
    gpu = non_expert_bytes(model) + budget
    dmap = infer_auto_device_map(
        model, max_memory={0: gpu, "cpu": 512 * GiB}, no_split_module_classes=no_split, dtype=DT
    )
    on_gpu = sum(d == 0 for d in dmap.values())
    log(f"accelerate: {on_gpu} of {len(dmap)} device-map entries on the GPU (max_memory {gpu / GiB:.1f} GiB)")
    dispatch_model(model, device_map=dmap)
    try:
        return measure_row(f"accelerate (max_memory {gpu / GiB:.0f} GiB)", model, args, args.new_accelerate)
    finally:
        remove_hook_from_submodules(model)  # offloaded weights go back to the host tensors they came from
        for attr in ("hf_device_map", "to", "cuda"):
            model.__dict__.pop(attr, None)
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()


# ------------------------------------------------------------------------------------------------------------
# routing traces
# ------------------------------------------------------------------------------------------------------------
def trace_hooks(layers, traces):
    """Forward pre-hooks that append each batch's set of routed experts to ``traces[layer]``."""

    def hook(i):
        def fn(module, args, kwargs):
            ids = args[1] if len(args) > 1 else kwargs["top_k_index"]
            traces[i].append(set(ids.reshape(-1).tolist()))

        return fn

    return lambda: [m.register_forward_pre_hook(hook(i), with_kwargs=True) for i, m in enumerate(layers)]


def replay(traces, slots, num_experts, top_k):
    """Hit rate of each policy and of the optimum, averaged over layers; the first batch opens the trace uncounted."""
    out = {}
    for policy in ("lru", "lfu", "frequency", "belady"):
        rates = []
        for trace in traces:
            r = belady(trace, slots) if policy == "belady" else simulate(trace, slots, num_experts, policy, spill=top_k)
            first = len(set(trace[0]))  # the opening batch: all misses, from an empty cache
            hits, misses = r["hits"], r["misses"] - first
            rates.append(hits / (hits + misses) if hits + misses else float("nan"))
        out[policy] = statistics.fmean(rates)
    return out


def zipf_traces(layers, num_experts, top_k, steps=256, s=1.0):
    """Per layer: ``steps`` batches of ``top_k`` distinct experts drawn from Zipf(s) over a shuffled expert order."""
    g = torch.Generator().manual_seed(3)
    weights = 1.0 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** s
    traces = []
    for _ in range(layers):
        order = torch.randperm(num_experts, generator=g)
        picks = torch.multinomial(weights.expand(steps, -1), top_k, replacement=False, generator=g)
        traces.append([set(order[p].tolist()) for p in picks])
    return traces


# ------------------------------------------------------------------------------------------------------------
# host link, our copies, overlap, CPU experts
# ------------------------------------------------------------------------------------------------------------
def link(nbytes, pinned, reps=10):
    """Median host->device GB/s of one ``nbytes`` copy."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned and DEV.type == "cuda")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    times = []
    for _ in range(reps + 1):
        t, _ = timed(lambda: dst.copy_(src, non_blocking=pinned), DEV)
        times.append(t)
    return nbytes / statistics.median(times[1:]) / 1e9


def load_bandwidth(layer, rows):
    """GB/s of ``rows`` back-to-back ``_load`` copies (our copy path); the slots are refilled as the cache
    says after."""
    S, E = layer.cache.num_slots, layer.num_experts
    saved = layer.stats.bytes_to_device
    layer._load(0, 0)  # warm
    t, _ = timed(lambda: [layer._load(i % E, i % S) for i in range(rows)], DEV)
    for s, e in enumerate(layer.cache.expert_in):
        if e >= 0:
            layer._load(e, s)
    sync(DEV)
    layer.stats.bytes_to_device = saved
    return rows * layer.layout.nbytes / t / 1e9


def in_place_rate(layer, top_k, reps=4):
    """GB/s of one token's experts step whose ``top_k`` experts are all read in place from host memory (the GPU's
    view of the page-locked store), as a graph-captured step reads missing experts; distinct experts each rep."""
    from tritonspec.nn.offload.offloaded import _kernel_names
    from tritonspec.ops.moe import moe_experts_tiered

    S, E, (layout, activation, clamp) = layer.cache.num_slots, layer.num_experts, layer.kind
    x = torch.randn(1, layer.layout.shapes[1][1][0 if layout == "concatenated" else 1], device=DEV, dtype=DT)
    weights = torch.full((1, top_k), 1.0 / top_k, device=DEV)
    ids = [S + (torch.arange(top_k, device=DEV) + r * top_k) % E for r in range(reps)]
    near, kw = _kernel_names(layer._slot_views), dict(layout=layout, activation=activation, clamp=clamp)

    def run():
        for r in range(reps):
            moe_experts_tiered(x, ids[r][None], weights, near, layer._far, **kw)

    with torch.no_grad():
        run()
        t, _ = timed(run, DEV)
    return reps * min(top_k, E) * layer.layout.nbytes / t / 1e9


def compute_step(model, layers):
    """Seconds of a single-token forward whose experts are all resident: the same token twice, the second timed."""
    tok = torch.tensor([[7]], device=DEV)
    with torch.no_grad():
        model(tok)
        before = sum(m.stats.hits for m in layers), sum(m.stats.misses + m.stats.cpu_experts for m in layers)
        t, _ = timed(lambda: model(tok), DEV)
    hits = sum(m.stats.hits for m in layers) - before[0]
    missed = sum(m.stats.misses + m.stats.cpu_experts for m in layers) - before[1]
    return t, hits / max(hits + missed, 1)


def dram_bandwidth():
    """Host DRAM read GB/s: sum of a 4 GB float32 tensor with all threads, best of 3."""
    x = torch.ones((2**30) if not SMOKE else 2**24, dtype=torch.float32)
    x.sum()
    best = min(timed(x.sum, DEV)[0] for _ in range(3))
    return x.numel() * 4 / best / 1e9


def cpu_expert_rate(layer, threads=None):
    """Weight GB/s of one-token experts on the CPU, cycling over distinct experts (at least 1 GB of them)."""
    views = layer.store.parts
    H = layer.layout.shapes[1][1][0] if layer.kind[0] == "concatenated" else layer.layout.shapes[1][1][1]
    x = torch.randn(1, H).to(layer.layout.dtype)
    n = min(layer.num_experts, max(3, -(-GiB // layer.layout.nbytes)))
    with torch_threads(threads):
        run_experts(x, 1, views, [0], layer.kind)
        t0 = time.perf_counter()
        for e in range(n):
            run_experts(x, 1, views, [e], layer.kind)
        t = time.perf_counter() - t0
    return n * layer.layout.nbytes / t / 1e9


# ------------------------------------------------------------------------------------------------------------
# the case
# ------------------------------------------------------------------------------------------------------------
def run_case(case, args):
    _, default_budget, default_new = CASES[case]
    new = args.new or default_new
    if SMOKE:
        new = 4
    log(f"{case}: building")
    t, model = timed(lambda: build(case, args.layers), DEV)
    cfg = model.config
    probe = expert_modules(model)
    per_expert = probe[0].gate_up_proj[0].numel() * DT.itemsize + probe[0].down_proj[0].numel() * DT.itemsize
    L, E, k = len(probe), probe[0].gate_up_proj.shape[0], cfg.num_experts_per_tok
    budget = SMOKE_SLOTS * L * per_expert if SMOKE else parse_bytes(args.budget or default_budget)
    log(
        f"{case}: built in {t:.0f} s; experts {L * E * per_expert / 1e9:.1f} GB, "
        f"rest {non_expert_bytes(model) / 1e9:.1f} GB, budget {budget / GiB:.2f} GiB"
    )
    del probe
    rows = []
    acc = accelerate_row(model, args, budget)
    if acc:
        rows.append(acc)

    log("offloading")
    t, handle = timed(lambda: offload_experts(model, gpu_budget=budget, device=DEV), DEV)
    layers = [m for _, m in handle.layers]
    slots = layers[0].cache.num_slots
    log(f"offloaded in {t:.0f} s: {slots} slots per layer of {E}")
    setup = f"offload_experts took {t:.0f} s; {slots} slots per layer of {E} experts, {per_expert / 1e6:.1f} MB each"
    traces = [[] for _ in layers]
    ours = {}
    for mode, prefetch in (("auto", True), (False, True), (False, False)):
        for m in layers:
            m.cpu_compute, m.prefetch = mode, prefetch
        handle.reset_stats()
        ours[mode, prefetch] = measure_row(
            f"ours (lru, prefetch {'on' if prefetch else 'off'}, cpu_compute={mode})",
            model,
            args,
            new,
            handle,
            warmup_hook=trace_hooks(layers, traces) if mode == "auto" else None,
        )
        rows.append(ours[mode, prefetch])

    # The bound's h is the cache's own hit rate: with prefetch, a guessed expert counts as a hit but was copied.
    copy = ours[False, False]
    host_row = link(per_expert, pinned=True)
    bw = load_bandwidth(layers[0], max(32, 2 * slots))
    t_compute, compute_hits = compute_step(model, layers)
    t_copy = copy["bytes_tok"] / (bw * 1e9)
    hidden = min(max((t_copy + t_compute - copy["step_s"]) / t_copy, 0.0), 1.0) if t_copy > 0 else float("nan")
    bound = host_row * 1e9 / ((1 - copy["hit"]) * L * k * per_expert) if copy["hit"] < 1 else float("inf")
    rows.append(dict(name=f"bound: pinned link / missed bytes (h={copy['hit']:.2f})", decode=bound))

    dram = dram_bandwidth()
    cpu_rate = cpu_expert_rate(layers[0])
    costs = layers[0].costs()
    log(f"layer 0 costs: {costs}")
    links = [
        (f"{what}, {'pinned' if p else 'pageable'}", link(n, pinned=p))
        for what, n in (("one expert row", per_expert), ("64 MB", 64 * 2**20))
        for p in (True, False)
    ]
    links.append((f"decode kernels reading {k} experts in place (graph steps)", in_place_rate(layers[0], k)))
    sims = {
        "random-weight model": replay([t for t in traces if len(t) > 1], slots, E, k),
        "synthetic Zipf": replay(zipf_traces(L, E, k), slots, E, k),
    }

    if case == "qwen3-30b-a3b":
        log("all on the GPU: revert, move")
        handle.revert()
        del handle, layers
        gc.collect()
        if DEV.type == "cuda":
            torch.cuda.empty_cache()  # our slots' blocks, so the experts' larger tensors fit
        model.to(DEV)
        rows.append(measure_row("all on GPU", model, args, new))

    return tables(
        case,
        setup,
        rows,
        sims,
        copy["hit"],
        slots,
        E,
        links,
        bw,
        t_copy,
        t_compute,
        compute_hits,
        copy["step_s"],
        hidden,
        dram,
        cpu_rate,
        costs,
    )


def tables(
    case,
    setup,
    rows,
    sims,
    our_hit,
    slots,
    E,
    links,
    bw,
    t_copy,
    t_compute,
    compute_hits,
    t_step,
    hidden,
    dram,
    cpu_rate,
    costs,
):
    f = lambda v, p=2: "-" if v is None or v != v else f"{v:.{p}f}"  # noqa: E731
    out = [
        f"### {case}",
        "",
        setup + ".",
        "",
        "| variant | decode tok/s | prefill tok/s | peak GPU GiB | hit rate | prefetch recall | "
        "MB moved / token | CPU expert share |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        mb = r.get("bytes_tok")
        out.append(
            f"| {r['name']} | {f(r['decode'])} | {f(r.get('prefill'), 0)} | {f(r.get('peak'), 1)} | "
            f"{f(r.get('hit'))} | {f(r.get('recall'))} | {f(mb / 1e6 if mb is not None else None, 1)} | "
            f"{f(r.get('cpu_share'))} |"
        )
    out += [
        "",
        f"Routing traces, {slots} slots per layer of {E} experts (hit rate, averaged over layers; "
        f"ours measured, copy-only, no prefetch: {f(our_hit)})",
        "",
        "| trace | LRU | LFU | frequency | Belady optimum |",
        "|---|---|---|---|---|",
    ]
    out += [
        f"| {name} | {f(s['lru'])} | {f(s['lfu'])} | {f(s['frequency'])} | {f(s['belady'])} |"
        for name, s in sims.items()
    ]
    out += ["", "| host -> device | GB/s |", "|---|---|"] + [f"| {n} | {v:.3g} |" for n, v in links]
    out += [
        f"| our loads (``_load``, rows back to back) | {bw:.3g} |",
        "",
        f"Overlap: t_copy {t_copy * 1e3:.1f} ms, t_compute {t_compute * 1e3:.1f} ms (hit rate {compute_hits:.2f}), "
        f"t_step {t_step * 1e3:.1f} ms: {f(hidden * 100, 0)} % of copy time hidden.",
        "",
        f"CPU experts: one-token expert {cpu_rate:.3g} GB/s of weights "
        f"(the module's cost model: {costs.cpu_stream / 1e9:.3g} GB/s, "
        f"{costs.cpu_flops / 1e12:.3g} TFLOP/s at 64 tokens, link {costs.host_link / 1e9:.3g} GB/s), "
        f"DRAM read {dram:.3g} GB/s: {cpu_rate / dram * 100:.0f} % of DRAM bandwidth.",
    ]
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", default="qwen3-30b-a3b", help=f"one of {', '.join(CASES)}, or all")
    ap.add_argument("--budget", help="GPU bytes of our expert slots, e.g. 16GiB (default: qwen 16GiB, mixtral 60GiB)")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the model's)")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--new", type=int, help="generated tokens (default: qwen 32, mixtral 8)")
    ap.add_argument("--new-accelerate", type=int, default=3, help="generated tokens for accelerate (slow)")
    ap.add_argument("--prefill", type=int, default=2048)
    ap.add_argument("--out")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args(argv)
    if SMOKE:
        args.prompt, args.prefill, args.new_accelerate = 8, 16, 2
    cases = list(CASES) if args.case == "all" else [args.case]
    torch.manual_seed(0)
    blocks = [run_case(c, args) for c in cases]
    name = torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu (interpreter)"
    head = (
        f"## Expert offload, {name}, torch {torch.__version__}, triton {triton.__version__}, "
        f"transformers {transformers.__version__}, {datetime.date.today()}"
    )
    text = head + "\n\n" + "\n\n".join(blocks)
    print(text)
    if args.out:
        with open(args.out, "a") as fh:
            fh.write(text + "\n\n")


if __name__ == "__main__":
    main()
