"""Runtime points: autotuner pruning, ``do_bench``, the host C compiler, FlagTree's driver spec API."""

from __future__ import annotations

import functools
import os

from ..hooks import SpecError
from ..resolve import current_backend, lookup, spec, spec_func
from . import LOCK, InstallPoint, patch


def _install_autotuner(autotuner):
    cls = autotuner.Autotuner
    orig = cls.prune_configs

    @functools.wraps(orig)
    def prune_configs(self, kwargs, *args, **kw):
        configs = orig(self, kwargs, *args, **kw)
        fn = lookup("get_pruned_configs")
        if fn is not None:
            configs = fn(list(configs), {**self.nargs, **kwargs})
            if not configs:
                raise SpecError(f"backend {current_backend()!r} get_pruned_configs returned no configs")
        return configs

    patch(cls, "prune_configs", prune_configs)


def _install_do_bench(testing):
    orig = testing.do_bench

    @functools.wraps(orig)
    def do_bench(*args, **kwargs):
        fn = lookup("do_bench")
        return (fn or orig)(*args, **kwargs)

    patch(testing, "do_bench", do_bench)


def _install_get_cc(build):
    if hasattr(build, "_find_compiler"):  # triton >= 3.7
        orig = build._find_compiler

        @functools.wraps(orig)
        def _find_compiler(language, *args, **kwargs):
            fn = lookup("get_cc") if language == "c" and "CC" not in os.environ else None
            return (fn() if fn is not None else None) or orig(language, *args, **kwargs)

        patch(build, "_find_compiler", _find_compiler)
        return
    orig = build._build  # triton 3.6 picks $CC inside _build

    @functools.wraps(orig)
    def _build(*args, **kwargs):
        fn = lookup("get_cc") if "CC" not in os.environ else None
        cc = fn() if fn is not None else None
        if cc is None:
            return orig(*args, **kwargs)
        with LOCK:
            os.environ["CC"] = cc
            try:
                return orig(*args, **kwargs)
            finally:
                del os.environ["CC"]

    patch(build, "_build", _build)


def _install_driver_api(driver_mod):
    patch(driver_mod, "spec", spec)
    patch(driver_mod, "spec_func", spec_func)


POINTS = (
    InstallPoint(
        "autotuner.prune_configs",
        "triton.runtime.autotuner",
        _install_autotuner,
        doc="Autotuner.prune_configs: backend config pruning",
    ),
    InstallPoint("testing.do_bench", "triton.testing", _install_do_bench, doc="triton.testing.do_bench"),
    InstallPoint("runtime.build", "triton.runtime.build", _install_get_cc, doc="host C compiler choice"),
    InstallPoint(
        "runtime.driver",
        "triton.runtime.driver",
        _install_driver_api,
        doc="from triton.runtime.driver import spec, spec_func",
    ),
)
