"""What the kernel benchmarks share: the timer, and launch-config overrides for their sweeps."""

from __future__ import annotations

import contextlib
import time


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
