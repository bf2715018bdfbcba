"""Compiler points: the ``compile()`` entry (target spec, tl injections, cache key), stages, options."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys

from .. import inject
from ..fingerprint import source_digest
from ..resolve import active_provider, compiling_for, lookup, value
from . import InstallPoint, injecting_spec, patch


def _install_compile(compiler_pkg):
    """Wrap ``triton.compile``: resolve the target's spec and key the cache by it; code generation
    (``ASTSource.make_ir``) runs with that spec's tl injections in place."""
    from triton.compiler import compiler as compiler_mod

    orig = compiler_mod.compile

    @functools.wraps(orig)
    def compile(src, target=None, options=None, _env_vars=None):
        if target is None:
            from triton.runtime.driver import driver

            target = driver.active.get_current_target()
        with compiling_for(target.backend):
            provider = active_provider()
            if provider is not None:
                if _env_vars is None:
                    _env_vars = compiler_mod.get_cache_invalidating_env_vars()
                _env_vars = {**_env_vars, "TRITONSPEC_SPEC": f"{provider.backend}:{provider.fingerprint}:{_self_key()}"}
            return orig(src, target=target, options=options, _env_vars=_env_vars)

    ast_source = compiler_mod.ASTSource
    orig_make_ir = ast_source.make_ir

    @functools.wraps(orig_make_ir)
    def make_ir(self, *args, **kwargs):
        with inject.applied(injecting_spec()):
            return orig_make_ir(self, *args, **kwargs)

    patch(compiler_mod, "compile", compile)
    patch(compiler_pkg, "compile", compile)
    patch(ast_source, "make_ir", make_ir)
    top = sys.modules.get("triton")
    if top is not None:  # mid-import, triton/__init__ copies triton.compiler.compile a moment later
        patch(top, "compile", compile, original=orig)


def _self_key() -> str:
    """Digest of the layer's own code: a changed hook installation must not reuse old binaries."""
    return source_digest(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _stages_hook(previous):

    def hook(*args):
        if not args:
            # Triton >= 3.7 asks for a cache-key contribution, on every launch. The spec is already
            # in the compile key (TRITONSPEC_SPEC) and in-memory caches are kept per selection
            # (SelectionCaches), so this adds nothing per launch but a constant.
            key, digest = previous() if previous is not None else ("", "")
            return key + "-tritonspec", digest
        backend, stages, options, language, capability = args
        if previous is not None:
            previous(*args)
        fn = lookup("pipeline_stages", target_backend=backend.target.backend)
        if fn is not None:
            fn(backend, stages, options, language, capability)

    hook.__tritonspec__ = True
    return hook


def _install_stages(knobs):
    patch(knobs.runtime, "add_stages_inspection_hook", _stages_hook(knobs.runtime.add_stages_inspection_hook))


def _install_parse_options(backends_mod):
    """Clamp ``num_stages`` to the spec's ``num_stages_cap`` where options are parsed (per compile)."""
    for backend in backends_mod.backends.values():
        cls = backend.compiler
        orig = cls.parse_options

        def parse_options(self, opts, _orig=orig):
            options = _orig(self, opts)
            cap = value("num_stages_cap", target_backend=self.target.backend)
            if cap is not None and getattr(options, "num_stages", 0) > cap:
                options = dataclasses.replace(options, num_stages=int(cap))
            return options

        patch(cls, "parse_options", functools.wraps(orig)(parse_options))


POINTS = (
    InstallPoint(
        "compiler.compile",
        "triton.compiler",
        _install_compile,
        doc="triton.compile: target spec, tl injections, spec fingerprint in the cache key",
    ),
    InstallPoint(
        "compiler.add_stages",
        "triton.knobs",
        _install_stages,
        min_version=(3, 6),
        doc="knobs.runtime.add_stages_inspection_hook: add or replace stages",
    ),
    InstallPoint(
        "compiler.parse_options",
        "triton.runtime.driver",
        _install_parse_options,
        doc="<Backend>.parse_options: num_stages cap",
    ),
)
