"""Launch-config variants for the benchmarks' sweeps (tuning data, not results)."""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def override(module, cfg):
    """Every kernel named in ``cfg`` gets those fields on top of its default: ``module`` (an op module)
    asks this version of ``launch_config``, which has no memo."""
    orig = module.launch_config

    def launch_config(config, device, default, **problem):
        base = default() if callable(default) else default
        return base.override(cfg.get(config.kernel, {}))

    module.launch_config = launch_config
    try:
        yield
    finally:
        module.launch_config = orig
