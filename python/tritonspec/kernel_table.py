"""The kernel table: every tritonspec kernel declared once, and read by everything that serves it.

An entry says where the kernel's op functions live, what it replaces in a model and how such a
place is recognized (the layer names ``use_kernel_forward_from_hub`` tags classes with, HF class
names, a structural detector, or a module-level function the models call), its registry type, its
hub layer, and the type of each of its Triton kernels' launch configs. The ops package, the
registry (LLaMA-Factory style), ``kernelize`` (Hugging Face ``kernels`` style), the YAML rules
(KTransformers style), the hub layers, the vendors' launch-config tables and ``tritonspec check``
all read this table: adding a kernel is one entry here plus its own code.

Registry kernel classes are generated from the entries, one per (kernel, device type), named
``<Device>Triton<Layer>Kernel`` after the entry's layer (``CudaTritonRMSNormKernel``, ...) and bound
in :mod:`tritonspec.nn.registry_kernels` under that name.

Nothing here imports torch: the table is read when Triton is imported (vendors' launch-config
tables are checked against it), so objects that live in heavier modules are named by
``"module:attribute"`` strings and loaded on use.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass, field
from typing import Callable, ClassVar

from .specialization.hooks import SpecError, suggest

# -- launch configs -------------------------------------------------------------------------------


class LaunchConfigError(SpecError, ValueError):
    """A launch config a kernel cannot run; names the kernel and the key (and the backend that sent it)."""


def _pow2(n: int) -> bool:
    return n >= 1 and not n & (n - 1)


@dataclass(frozen=True, kw_only=True)
class LaunchConfig:
    """Launch parameters of one Triton kernel: its tile constexprs and Triton's launch options.

    Subclasses add the kernel's own fields and set ``kernel`` (the name backends know it by). Every
    instance is checked when built: ``BLOCK_*`` and ``num_warps`` are powers of two, counts are >= 1,
    a field's ``metadata={"range": (lo, hi)}`` bounds it, bools are bools. A backend's override goes
    through :meth:`override`, so an unknown key is an error that names the nearest ones.
    """

    kernel: ClassVar[str] = ""
    num_warps: int = 4
    num_stages: int | None = None  # None: Triton's default
    maxnreg: int | None = None  # a register cap per thread (warp-specialized kernels)

    def __post_init__(self):
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.default is None:
                continue
            where = f"{self.kernel}: {f.name}={value!r}"
            if f.type in (bool, "bool"):
                if not isinstance(value, bool):
                    raise LaunchConfigError(f"{where} must be a bool, not {type(value).__name__}")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise LaunchConfigError(f"{where} must be an int, not {type(value).__name__}")
            if value < 1:
                raise LaunchConfigError(f"{where} must be >= 1")
            if (f.name.startswith("BLOCK") or f.name == "num_warps") and not _pow2(value):
                raise LaunchConfigError(f"{where} must be a power of two")
            lo, hi = f.metadata.get("range", (1, None))
            if value < lo or (hi is not None and value > hi):
                raise LaunchConfigError(f"{where} must be from {lo} to {hi}")
        opts = {"num_warps": self.num_warps}
        if self.num_stages is not None:
            opts["num_stages"] = self.num_stages
        if self.maxnreg is not None:
            opts["maxnreg"] = self.maxnreg
        object.__setattr__(self, "options", opts)  # the launch keywords; the other fields are constexprs

    @classmethod
    def keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def override(self, changes: dict, where: str = ""):
        """A copy with ``changes`` (a backend's dict) applied and checked; errors start with ``where``
        (what sent the changes) instead of the kernel's name."""
        known = self.keys()
        where = where or f"{self.kernel}: "
        for name in changes:
            if name not in known:
                raise LaunchConfigError(
                    f"{where}unknown launch parameter {name!r}{suggest(str(name), known)}; "
                    f"{self.kernel!r} takes {', '.join(known)}"
                )
        try:
            return dataclasses.replace(self, **changes)
        except LaunchConfigError as e:
            raise LaunchConfigError(where + str(e).removeprefix(f"{self.kernel}: ")) from None


@dataclass(frozen=True, kw_only=True)
class DependentLaunch(LaunchConfig):
    """A decode-step kernel that may run with programmatic dependent launch (sm90+): at a few microseconds a
    launch, starting while the kernel before it ends is a measurable share of its time."""

    PDL: bool = False  # the kernel's constexpr: it waits on the previous grid before touching what that wrote

    def __post_init__(self):
        super().__post_init__()
        if self.PDL:  # the launch option goes with the constexpr, never one without the other
            self.options["launch_pdl"] = True


@dataclass(frozen=True, kw_only=True)
class RowTile(LaunchConfig):
    """A (BLOCK_M rows, BLOCK_N columns) tile: RMSNorm and SwiGLU."""

    BLOCK_M: int
    BLOCK_N: int


@dataclass(frozen=True, kw_only=True)
class RMSNormForward(RowTile):
    kernel: ClassVar[str] = "rms_norm_fwd"


@dataclass(frozen=True, kw_only=True)
class RMSNormBackward(RowTile):
    kernel: ClassVar[str] = "rms_norm_bwd"
    programs_per_unit: int = 2  # persistent programs per SM: each keeps an fp32 dW partial


@dataclass(frozen=True, kw_only=True)
class SwiGLUForward(RowTile):
    kernel: ClassVar[str] = "swiglu_fwd"


@dataclass(frozen=True, kw_only=True)
class SwiGLUBackward(RowTile):
    kernel: ClassVar[str] = "swiglu_bwd"


@dataclass(frozen=True, kw_only=True)
class RoPE(LaunchConfig):
    """BLOCK_S positions x BLOCK_HQ (q) or BLOCK_HK (k) heads per tile, forward and backward alike."""

    kernel: ClassVar[str] = "rope"
    BLOCK_S: int
    BLOCK_HQ: int
    BLOCK_HK: int


# Attention tiles: the padded lse/delta rows are whole tiles of at most 256 rows.
_ATTENTION_BLOCK = {"range": (16, 256)}


@dataclass(frozen=True, kw_only=True)
class AttentionForward(LaunchConfig):
    kernel: ClassVar[str] = "attention_fwd"
    BLOCK_M: int = field(metadata=_ATTENTION_BLOCK)
    BLOCK_N: int = field(metadata=_ATTENTION_BLOCK)
    TMA: bool = False  # host tensor descriptors
    WARP_SPECIALIZE: bool = False  # Triton's automatic warp specialization of the key loop


@dataclass(frozen=True, kw_only=True)
class AttentionBackwardKV(LaunchConfig):
    kernel: ClassVar[str] = "attention_bwd_dkdv"
    BLOCK_M: int = field(metadata=_ATTENTION_BLOCK)
    BLOCK_N: int = field(metadata=_ATTENTION_BLOCK)
    TMA: bool = False
    DQ_ATOMIC: bool = False  # dQ added up by this kernel with fp32 atomics instead of a dQ pass
    DQ_TMA_REDUCE: bool = False  # those atomics as bulk TMA reduce-adds


@dataclass(frozen=True, kw_only=True)
class AttentionBackwardQ(LaunchConfig):
    kernel: ClassVar[str] = "attention_bwd_dq"
    BLOCK_M: int = field(metadata=_ATTENTION_BLOCK)
    BLOCK_N: int = field(metadata=_ATTENTION_BLOCK)
    TMA: bool = False


@dataclass(frozen=True, kw_only=True)
class AttentionPreprocess(LaunchConfig):
    kernel: ClassVar[str] = "attention_bwd_preprocess"
    BLOCK_M: int = field(default=64, metadata=_ATTENTION_BLOCK)


@dataclass(frozen=True, kw_only=True)
class AttentionDecode(DependentLaunch):
    """Flash-decoding's partial kernel: a kv head's (q heads x queries) rows as a BLOCK_M tile (several tiles
    when more), BLOCK_N keys a step; the keys split so the grid holds ``programs_per_unit`` programs per SM,
    each split at least ``min_split_keys`` keys (both host-side only)."""

    kernel: ClassVar[str] = "attention_decode"
    BLOCK_M: int = field(metadata={"range": (16, 256)})
    BLOCK_N: int = field(metadata={"range": (16, 256)})
    min_split_keys: int = 64
    programs_per_unit: int = 2


@dataclass(frozen=True, kw_only=True)
class AttentionDecodeCombine(DependentLaunch):
    """Flash-decoding's combine: one output row per program, BLOCK_S splits' partials a step."""

    kernel: ClassVar[str] = "attention_decode_combine"
    BLOCK_S: int


@dataclass(frozen=True, kw_only=True)
class LinearCrossEntropy(LaunchConfig):
    """The fused LM head's cross-entropy row kernel: one program per token, BLOCK_V logits a step."""

    kernel: ClassVar[str] = "linear_cross_entropy"
    BLOCK_V: int


@dataclass(frozen=True, kw_only=True)
class MoEGemm(LaunchConfig):
    """What the experts' grouped GEMMs share: BLOCK_N columns, BLOCK_K deep steps, and GROUP_M M blocks whose N
    blocks run together (their rows and the expert's columns stay in L2)."""

    BLOCK_N: int
    BLOCK_K: int
    GROUP_M: int = 8


@dataclass(frozen=True, kw_only=True)
class MoEUp(MoEGemm):
    """The experts' gate/up grouped GEMM; its BLOCK_M is also the row alignment of every expert's rows."""

    kernel: ClassVar[str] = "moe_up"
    BLOCK_M: int
    TMA: bool = False  # the weight's tiles by a host tensor descriptor ([gate; up] layout)


@dataclass(frozen=True, kw_only=True)
class MoERows(MoEGemm):
    """The experts' row GEMMs (down projection, dout @ down^T, dx); their BLOCK_M is moe_up's."""

    kernel: ClassVar[str] = "moe_rows"
    TMA: bool = False  # the weight's tiles by a host tensor descriptor


@dataclass(frozen=True, kw_only=True)
class MoEWeightGrad(MoEGemm):
    """The experts' weight gradients: (BLOCK_M x BLOCK_N) tiles of an expert's weight, BLOCK_K rows a step."""

    kernel: ClassVar[str] = "moe_weight_grad"
    BLOCK_M: int
    TMA: bool = False  # both operands' tiles by host tensor descriptors (the rows sorted first)


@dataclass(frozen=True, kw_only=True)
class MoEDecode(DependentLaunch):
    """Decode-sized experts' GEMMs (at most 16 tokens, no sort): BLOCK_N columns of one expert, BLOCK_K deep."""

    kernel: ClassVar[str] = "moe_decode"
    BLOCK_N: int
    BLOCK_K: int


@dataclass(frozen=True, kw_only=True)
class MoECombine(LaunchConfig):
    """The top-k gather-reduce: BLOCK_T tokens x BLOCK_H columns."""

    kernel: ClassVar[str] = "moe_combine"
    BLOCK_T: int
    BLOCK_H: int


@dataclass(frozen=True, kw_only=True)
class MoERoute(LaunchConfig):
    """The router's fused top-k (calls without gradient or group limit): BLOCK_T tokens a program, each row's
    experts in one block."""

    kernel: ClassVar[str] = "moe_route"
    BLOCK_T: int


# -- kernels ------------------------------------------------------------------------------------------

SITES = {
    "module": "rebinds forward of the model's modules that match",
    "function": "replaces a module-level function the model's classes call (where the models look it up)",
    "attention": "switches the model's attention implementation (transformers' AttentionInterface)",
}


@dataclass(frozen=True)
class Layer:
    """What a kernel replaces in a model, and how such a place is recognized.

    Args:
        name: the layer name: the hub layer class in ``impl``'s module, what ``use_kernel_forward_from_hub``
            tags classes with, and the key of kernelize's default mapping.
        impl: the hub-style layer (``"module:Class"`` or the class): a pure ``nn.Module`` whose forward
            replaces the original's (huggingface/kernels' layer contract).
        tags: more layer names that select it (transformers' names, e.g. ``rotary_pos_emb``).
        classes: model class names it replaces wherever they appear, tagged or not.
        detect: a structural check for untagged modules (``"module:function"`` or a callable taking
            the module), or for ``site="function"`` a check of the model's function: what the layer
            relies on, not a per-model class list.
        function: for ``site="function"``: the module-level name the models call.
    """

    name: str
    impl: str | type
    tags: tuple[str, ...] = ()
    classes: tuple[str, ...] = ()
    detect: str | Callable | None = None
    function: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.name, *self.tags)

    @property
    def tag(self) -> str:
        """The name Hugging Face code tags this layer with (the first tag, else the layer name)."""
        return self.tags[0] if self.tags else self.name

    def load(self) -> type:
        return _load(self.impl)

    def detector(self) -> Callable | None:
        return _load(self.detect) if self.detect is not None else None


@dataclass(frozen=True)
class Kernel:
    """One kernel: its ops, where it goes in a model, its registry type and its launch configs.

    Args:
        name: the kernel's name (also the registry type's value: ``KernelType(name)``).
        module: the module defining its op functions (``tritonspec.ops.<name>`` for ours).
        ops: the public op functions of that module (``from tritonspec.ops import <op>``).
        site: how it is installed into a model, one of ``SITES``.
        layer: what it replaces (None: the site says it all, e.g. attention).
        configs: the launch-config type of each of its Triton kernels.
    """

    name: str
    module: str
    ops: tuple[str, ...]
    site: str
    layer: Layer | None = None
    configs: tuple[type[LaunchConfig], ...] = ()

    def __post_init__(self):
        if self.site not in SITES:
            raise ValueError(f"kernel {self.name!r}: site must be one of {', '.join(SITES)}, got {self.site!r}")
        if self.site != "attention" and self.layer is None:
            raise ValueError(f"kernel {self.name!r}: a {self.site!r} site needs a layer")
        if self.site == "function" and not (self.layer and self.layer.function):
            raise ValueError(f"kernel {self.name!r}: a 'function' site needs layer.function")
        for cfg in self.configs:
            if not (isinstance(cfg, type) and issubclass(cfg, LaunchConfig) and cfg.kernel):
                raise TypeError(
                    f"kernel {self.name!r}: configs must be LaunchConfig subclasses with a kernel name, got {cfg!r}"
                )

    def op(self, name: str) -> Callable:
        if name not in self.ops:
            raise AttributeError(f"kernel {self.name!r} has no op {name!r}; it has {', '.join(self.ops)}")
        return getattr(importlib.import_module(self.module), name)


def _load(ref):
    if not isinstance(ref, str):
        return ref
    module, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module), attr)


_HUB = "tritonspec.nn.hub.layers"
_DETECTORS = "tritonspec.nn.detectors"

KERNELS: dict[str, Kernel] = {}


def declare(kernel: Kernel) -> Kernel:
    """Add ``kernel`` to the table (ours below; a vendor's or an experiment's the same way)."""
    if not isinstance(kernel, Kernel):
        raise TypeError(f"declare: expected a tritonspec.kernel_table.Kernel, got {type(kernel).__name__}")
    if kernel.name in KERNELS:
        raise ValueError(f"declare: kernel {kernel.name!r} is already declared")
    taken = {n: k.name for k in KERNELS.values() if k.layer for n in k.layer.names}
    for n in kernel.layer.names if kernel.layer else ():
        if n in taken:
            raise ValueError(f"declare: layer name {n!r} of kernel {kernel.name!r} already belongs to {taken[n]!r}")
    configs = config_types()
    for cfg in kernel.configs:
        if cfg.kernel in configs:
            raise ValueError(f"declare: launch config {cfg.kernel!r} of kernel {kernel.name!r} is already declared")
    KERNELS[kernel.name] = kernel
    _changed()
    return kernel


def withdraw(name: str) -> None:
    """Remove a declared kernel (experiments and tests)."""
    if KERNELS.pop(name, None) is not None:
        _changed()


_listeners: list = []


def on_change(fn) -> None:
    """Call ``fn()`` whenever a kernel is declared or withdrawn (consumers rebuild what they derive)."""
    _listeners.append(fn)


def _changed() -> None:
    for fn in list(_listeners):
        fn()


def config_types() -> dict[str, type[LaunchConfig]]:
    """Triton kernel name -> its launch-config type, over every declared kernel."""
    return {cfg.kernel: cfg for k in KERNELS.values() for cfg in k.configs}


def layers() -> dict[str, Kernel]:
    """Every layer name (and tag) -> the kernel whose layer it names."""
    return {n: k for k in KERNELS.values() if k.layer for n in k.layer.names}


def get(name: str) -> Kernel:
    try:
        return KERNELS[name]
    except KeyError:
        raise KeyError(f"{name!r} is not a declared kernel{suggest(name, KERNELS)}") from None


# -- the table ------------------------------------------------------------------------------------------

declare(
    Kernel(
        "rmsnorm",
        "tritonspec.ops.rms_norm",
        ("rms_norm",),
        "module",
        Layer("RMSNorm", f"{_HUB}:RMSNorm", detect=f"{_DETECTORS}:is_rms_norm"),
        (RMSNormForward, RMSNormBackward),
    )
)
# The residual add after attention fused into the post-attention RMSNorm of a decoder layer. Its Triton kernels
# are rmsnorm's (the residual is a constexpr branch of them), so their launch configs are declared there.
declare(
    Kernel(
        "add_rmsnorm",
        "tritonspec.ops.rms_norm",
        ("add_rms_norm",),
        "module",
        Layer("DecoderLayer", f"{_HUB}:DecoderLayer", detect=f"{_DETECTORS}:is_llama_decoder_layer"),
    )
)
declare(
    Kernel(
        "swiglu",
        "tritonspec.ops.swiglu",
        ("swiglu",),
        "module",
        Layer("SwiGLUMLP", f"{_HUB}:SwiGLUMLP", detect=f"{_DETECTORS}:is_swiglu_mlp"),
        (SwiGLUForward, SwiGLUBackward),
    )
)
declare(
    Kernel(
        "rope",
        "tritonspec.ops.rope",
        ("rope",),
        "function",
        Layer(
            "RotaryPosEmb",
            f"{_HUB}:RotaryPosEmb",
            tags=("rotary_pos_emb",),
            detect=f"{_DETECTORS}:is_rotate_half_rope",
            function="apply_rotary_pos_emb",
        ),
        (RoPE,),
    )
)
# Decode steps' attention (a few queries against a KV cache, forward only): no site of its own in a model, it
# serves the attention implementation that flash_attention installs, so it takes the same "attention" site (its
# registry kernel switches the same implementation). Declared first, so the registry applies flash_attention's
# switch last and the model's report credits it, as before this kernel existed.
declare(
    Kernel(
        "flash_decoding",
        "tritonspec.ops.attention_decode",
        ("attention_decode",),
        "attention",
        None,
        (AttentionDecode, AttentionDecodeCombine),
    )
)
declare(
    Kernel(
        "flash_attention",
        "tritonspec.ops.attention",
        ("attention", "causal_key_bounds", "key_bounds_from_mask"),
        "attention",
        None,
        (AttentionForward, AttentionBackwardKV, AttentionBackwardQ, AttentionPreprocess),
    )
)
declare(
    Kernel(
        "linear_cross_entropy",
        "tritonspec.ops.linear_cross_entropy",
        ("linear_cross_entropy",),
        "module",
        Layer("CausalLMLoss", f"{_HUB}:CausalLMLoss", detect=f"{_DETECTORS}:is_causal_lm_head"),
        (LinearCrossEntropy,),
    )
)
# The same fused head + loss behind the MoE causal LMs' forward signature (``output_router_logits``): a hub
# layer mirrors one signature, so the MoE models get a layer of their own; the op and its config are above.
declare(
    Kernel(
        "moe_linear_cross_entropy",
        "tritonspec.ops.linear_cross_entropy",
        (),
        "module",
        Layer("MoeCausalLMLoss", f"{_HUB}:MoeCausalLMLoss", detect=f"{_DETECTORS}:is_moe_causal_lm_head"),
    )
)
declare(
    Kernel(
        "moe",
        "tritonspec.ops.moe",
        ("moe_experts",),
        "module",
        Layer("MoEExperts", f"{_HUB}:MoEExperts", detect=f"{_DETECTORS}:is_fused_experts"),
        (MoEUp, MoERows, MoEWeightGrad, MoECombine, MoEDecode),
    )
)
declare(
    Kernel(
        "moe_router",
        "tritonspec.ops.moe_routing",
        ("moe_route",),
        "module",
        Layer("MoERouter", f"{_HUB}:MoERouter", detect=f"{_DETECTORS}:is_topk_router"),
        (MoERoute,),
    )
)
