"""Cold experts computed on the CPU, and the cost model that decides per batch between that and a copy.

For decode a routed expert reads all of its weights for a handful of tokens. Copying it to the GPU costs
``bytes / host_link``; computing it where it lies costs ``bytes / cpu_stream + tokens * flops / cpu_flops``.
Both rates are measured once per process and device on an expert of the real shape
(:func:`measure`), so the choice follows the machine: a fast CPU next to a PCIe link keeps Mixtral-sized
experts of single tokens on the CPU, while prefill, whose many tokens per expert make the CPU's FLOP rate
the bottleneck, copies. The CPU's share runs while the GPU computes the resident experts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from ...ops.moe import moe_experts_ref


@dataclass
class Costs:
    """Measured rates: bytes/s host->device (one expert row), bytes/s of weights the CPU streams through
    a one-token expert, FLOP/s of the CPU's expert matmuls at 64 tokens; and ``cpu_scale``, how much
    longer the CPU really takes than predicted (learned in use, shared by every layer of the shape)."""

    host_link: float
    cpu_stream: float
    cpu_flops: float
    cpu_scale: float = 1.0

    def copy_s(self, nbytes: int) -> float:
        return nbytes / self.host_link

    def cpu_s(self, nbytes: int, tokens: int, flops_per_token: float) -> float:
        return self.cpu_scale * (nbytes / self.cpu_stream + tokens * flops_per_token / self.cpu_flops)

    def learn(self, predicted_s: float, spent_s: float) -> None:
        """Fold a real CPU time into the scale (a running mean of real / predicted)."""
        if predicted_s > 0:
            self.cpu_scale = 0.5 * self.cpu_scale + 0.5 * self.cpu_scale * spent_s / predicted_s


def choose_cpu(tokens: dict[int, int], nbytes: int, flops_per_token: float, costs: Costs) -> set[int]:
    """Which missing experts (``tokens``: expert -> routed tokens) to compute on the CPU.

    Copies serialize on the host link and CPU experts on the CPU, and the two overlap, so the batch waits
    for the longer of the two queues: move experts to the CPU, cheapest first, while that shortens it.
    """
    copy = costs.copy_s(nbytes)
    ranked = sorted(tokens, key=lambda e: (costs.cpu_s(nbytes, tokens[e], flops_per_token), e))
    on_cpu, cpu_total, copy_total = set(), 0.0, copy * len(tokens)
    for e in ranked:
        t = costs.cpu_s(nbytes, tokens[e], flops_per_token)
        if max(cpu_total + t, copy_total - copy) < max(cpu_total, copy_total):
            on_cpu.add(e)
            cpu_total += t
            copy_total -= copy
    return on_cpu


_MEASURED: dict[tuple, Costs] = {}


def _best(fn, reps: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


_MEASURE_BYTES = 1 << 30  # the CPU is timed over this many bytes of distinct experts: DRAM, not its caches


def measure(
    device: torch.device,
    parts: dict[str, torch.Tensor],
    kind: tuple,
    flops_per_token: float,
    threads: int | None = None,
) -> Costs:
    """Time one expert's copy to ``device`` (``parts``: a store's ``(E, ...)`` host tensors, one copy per tensor,
    as the module copies) and the CPU experts on 1 and 64 tokens; cached per shape.

    The CPU runs distinct experts (up to ``_MEASURE_BYTES`` of them) so their weights come from DRAM
    as they will in use; the cost model corrects itself afterwards from the real CPU times anyway.
    """
    first = {n: t[0] for n, t in parts.items()}
    dtype = first["down_proj"].dtype
    key = (str(device), tuple((n, tuple(t.shape)) for n, t in first.items()), dtype, kind, threads)
    if key in _MEASURED:
        return _MEASURED[key]
    nbytes = sum(t.numel() * t.element_size() for t in first.values())
    dst = {n: torch.empty_like(t, device=device) for n, t in first.items()}

    def copy():
        for n, t in first.items():
            dst[n].copy_(t, non_blocking=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    link = nbytes / _best(copy)
    H = parts["down_proj"].shape[1] if kind[0] == "concatenated" else parts["down_proj"].shape[2]
    n = max(1, min(parts["down_proj"].shape[0], _MEASURE_BYTES // nbytes))

    def cpu(tokens):
        x = torch.randn(tokens, H, dtype=dtype)
        return _best(lambda: [run_experts(x, 1, parts, [e], kind) for e in range(n)]) / n

    with torch_threads(threads):
        t1, t64 = cpu(1), cpu(64)
    # 64 tokens' FLOPs over their whole time, weights' reading included: a rate that never flatters the CPU.
    costs = _MEASURED[key] = Costs(link, nbytes / t1, 64 * flops_per_token / t64)
    return costs


class torch_threads:
    """``torch.set_num_threads(n)`` for the duration of a block (None: leave it)."""

    def __init__(self, n: int | None):
        self.n, self.old = n, None

    def __enter__(self):
        if self.n is not None:
            self.old = torch.get_num_threads()
            torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        if self.old is not None:
            torch.set_num_threads(self.old)


def run_experts(
    x: torch.Tensor,
    top_k: int,
    rows: dict[str, torch.Tensor],
    experts,
    kind: tuple,
    ids: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """``experts`` of ``rows`` (a store's ``(E, ...)`` views) on host tokens ``x``, in the weights' dtype,
    summed in float32; with no ``ids`` every token goes to ``experts[0]`` with weight 1 (timing)."""
    if ids is None:
        ids = torch.full((x.shape[0], top_k), experts[0], dtype=torch.int64)
        weights = torch.ones(ids.shape)
    layout, activation, clamp = kind
    return moe_experts_ref(
        x,
        ids,
        weights,
        rows["gate_up_proj"],
        rows["down_proj"],
        gate_up_bias=rows.get("gate_up_proj_bias"),
        down_bias=rows.get("down_proj_bias"),
        layout=layout,
        activation=activation,
        clamp=clamp,
        dtype=x.dtype,
        experts=experts,
    )
