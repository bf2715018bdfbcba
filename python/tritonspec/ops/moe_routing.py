"""The router of Mixture-of-Experts layers: which experts each token goes to, and with what weights.

One function, ``moe_route``, covers the routers of the Hugging Face MoE families by its arguments
(Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3). Its torch path picks the same experts in
the same order and computes the same weights as their routers, since it runs the same torch ops in the
same order: a reordered sum or a top-k over other values would flip near-ties and move weights by an ulp.

The math is float32 whatever the logits' dtype: in bfloat16 near-equal scores round together and the
chosen experts change (vLLM runs DeepSeek's router in float32 for that reason). Pure torch with no
host synchronization and no data-dependent shapes, so it is CUDA-graph capturable and traces under
``torch.compile(fullgraph=True)``; the weights are differentiable with respect to the logits.

Calls on a GPU that take no gradient and limit no groups (decode, inference) run one Triton kernel
instead (``_fusable`` says which): ``torch.topk`` is two CUDA kernels (a gather and a bitonic sort) and the
softmax a third, ~9 us of a decode layer on an H100 for tens of bytes per token. The kernel computes the
same float32 math its own way (its exp, its sums), so its weights may differ from the torch path's by
float32 rounding, and a near-tie that rounding flips may choose another expert; ties go to the lower expert
index. It is as capturable and traceable (a torch.library op under ``torch.compile``). Gradients, group
limits and CPU tensors keep the torch path.

What comes after it is the experts' (:mod:`tritonspec.ops.moe`): they sort the chosen (token, expert)
pairs by expert (:mod:`tritonspec.ops.moe_sort`) and run the grouped GEMMs.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..devices import triton_runs
from ..kernel_table import MoERoute
from ..launch import launch_config
from ._library import PlanCache, _schema_of, cdiv, launch, library_op, next_pow2, use_library_op

_OP = "moe_route"

SCORINGS = ("softmax", "sigmoid", "topk_softmax")

# DeepSeek-V3's router adds this to the sum it renormalizes by; kept for the same rounding.
_SIGMOID_RENORM_EPS = 1e-20


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check(router_logits, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor) -> None:
    """Every error names the argument; only shapes and types are read (nothing synchronizes)."""
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"{_OP}: argument 'router_logits' must be a torch.Tensor, got {type(router_logits).__name__}")
    if not router_logits.is_floating_point():
        raise TypeError(f"{_OP}: argument 'router_logits' has dtype {router_logits.dtype}; expected a floating dtype")
    if router_logits.dim() != 2:
        raise ValueError(
            f"{_OP}: argument 'router_logits' must have 2 dimensions (tokens, experts), got shape "
            f"{tuple(router_logits.shape)}"
        )
    n_experts = router_logits.shape[1]
    if not _is_int(top_k):
        raise TypeError(f"{_OP}: argument 'top_k' must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= n_experts:
        raise ValueError(f"{_OP}: argument 'top_k' must be in 1..{n_experts} (the number of experts), got {top_k}")
    if scoring not in SCORINGS:
        raise ValueError(f"{_OP}: argument 'scoring' must be one of {', '.join(map(repr, SCORINGS))}, got {scoring!r}")
    if isinstance(scaling_factor, bool) or not isinstance(scaling_factor, (int, float)):
        raise TypeError(f"{_OP}: argument 'scaling_factor' must be a float, got {type(scaling_factor).__name__}")
    if correction_bias is not None:
        if not isinstance(correction_bias, torch.Tensor):
            raise TypeError(
                f"{_OP}: argument 'correction_bias' must be a torch.Tensor or None, got "
                f"{type(correction_bias).__name__}"
            )
        if not correction_bias.is_floating_point():
            raise TypeError(
                f"{_OP}: argument 'correction_bias' has dtype {correction_bias.dtype}; expected a floating dtype"
            )
        if tuple(correction_bias.shape) != (n_experts,):
            raise ValueError(
                f"{_OP}: argument 'correction_bias' must have shape ({n_experts},) (one per expert), "
                f"got {tuple(correction_bias.shape)}"
            )
        if correction_bias.device != router_logits.device:
            raise ValueError(
                f"{_OP}: argument 'correction_bias' is on {correction_bias.device} but 'router_logits' "
                f"is on {router_logits.device}"
            )
    if n_group is None:
        if topk_group is not None:
            raise ValueError(f"{_OP}: argument 'topk_group' needs 'n_group' (the number of expert groups)")
        return
    if not _is_int(n_group):
        raise TypeError(f"{_OP}: argument 'n_group' must be an int or None, got {type(n_group).__name__}")
    if n_group < 1 or n_experts % n_group:
        raise ValueError(f"{_OP}: argument 'n_group' must divide the number of experts ({n_experts}), got {n_group}")
    if n_experts // n_group < 2:
        raise ValueError(
            f"{_OP}: argument 'n_group' leaves {n_experts // n_group} expert per group; groups are "
            "scored by their top 2 experts, so each needs at least 2"
        )
    if topk_group is None:
        raise ValueError(f"{_OP}: argument 'topk_group' (how many groups to keep) is needed with 'n_group'")
    if not _is_int(topk_group):
        raise TypeError(f"{_OP}: argument 'topk_group' must be an int, got {type(topk_group).__name__}")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"{_OP}: argument 'topk_group' must be in 1..{n_group} (n_group), got {topk_group}")
    if topk_group * (n_experts // n_group) < top_k:
        raise ValueError(
            f"{_OP}: argument 'topk_group'={topk_group} keeps {topk_group * (n_experts // n_group)} "
            f"experts ({n_experts // n_group} per group), fewer than top_k={top_k}"
        )


def _keep_top_groups(choice: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """``choice`` with -inf outside each token's ``topk_group`` best groups (DeepSeek-V3's group limit).

    A group's score is the sum of its two best choice scores; the groups are picked by
    ``topk(sorted=False)`` as in Hugging Face's router, so ties at the cut keep the same groups."""
    group_scores = choice.unflatten(-1, (n_group, -1)).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    expert_mask = group_mask.unsqueeze(-1).expand(-1, -1, choice.shape[-1] // n_group).flatten(1)
    return choice.masked_fill(~expert_mask, float("-inf"))


# ----------------------------------------------------------------------------------------------
# the fused path: no gradient, no group limit
# ----------------------------------------------------------------------------------------------
_SOFTMAX, _SIGMOID, _TOPK_SOFTMAX = 0, 1, 2
_SCORING_CODE = {"softmax": _SOFTMAX, "sigmoid": _SIGMOID, "topk_softmax": _TOPK_SOFTMAX}

# The kernel holds a row's experts in registers; more experts than this take the torch path.
MAX_FUSED_EXPERTS = 1024

# CPU tensors take the kernel (through Triton's interpreter) only when this is set, as tests do: there it is
# slower than torch's ops, and the torch path is what tritonspec.nn.detectors verifies a router against, bit
# for bit, on CPU tensors.
FUSED_ON_CPU = False
_FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


@triton.jit
def _moe_route_kernel(
    # Pointers: logits (tokens, experts) by strides; bias (experts,) by stride where HAS_BIAS; weights (tokens,
    # TOP_K) fp32 and ids (tokens, TOP_K) int64, contiguous
    LOGITS,
    BIAS,
    WEIGHTS,
    IDS,
    # Sizes
    T,
    E,
    # Strides
    stride_lt,
    stride_le,
    stride_b,
    # Scales
    scaling_factor,
    # Meta-parameters
    TOP_K: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCORING: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    RENORMALIZE: tl.constexpr,
    SIGMOID_EPS: tl.constexpr,
):
    """BLOCK_T tokens' routing: scores in fp32, then TOP_K rounds of (max, lowest index holding it) over the
    choice values, so the ids come in descending choice order and a tie goes to the lowest expert index. A NaN
    choice ranks first, as in ``torch.topk``; every id is a distinct expert below E whatever the values (the
    experts' kernels index by them)."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < T
    cols = tl.arange(0, BLOCK_E)
    col_ok = cols < E
    ptrs = LOGITS + rows.to(tl.int64)[:, None] * stride_lt + cols[None, :] * stride_le
    x = tl.load(ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    x = tl.where(col_ok[None, :], x, float("-inf"))  # padded experts weigh 0; padded rows (0.0) make no NaN
    if SCORING == 0:  # softmax over the experts, as torch's: exp(x - max) / sum
        e = tl.exp(x - tl.max(x, 1)[:, None])
        scores = e / tl.sum(e, 1)[:, None]
    elif SCORING == 1:
        scores = 1.0 / (1.0 + tl.exp(-x))
    else:  # topk_softmax: choose on the logits
        scores = x
    choice = scores
    if HAS_BIAS:
        choice += tl.load(BIAS + cols * stride_b, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    choice = tl.where(choice != choice, float("inf"), choice)  # NaN first, as torch.topk ranks it
    free = col_ok[None, :] & row_ok[:, None]
    ks = tl.arange(0, BLOCK_K)
    w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    ids = tl.zeros([BLOCK_T, BLOCK_K], tl.int32)
    for k in range(TOP_K):
        c = tl.where(free, choice, float("-inf"))
        best = tl.max(c, 1)
        # the lowest free index holding the max, also when it is -inf (a free column always qualifies)
        pick = tl.min(tl.where(free & (c == best[:, None]), cols[None, :], BLOCK_E), 1)
        hit = cols[None, :] == pick[:, None]
        score = tl.sum(tl.where(hit, scores, 0.0), 1)
        free = free & ~hit
        w = tl.where(ks[None, :] == k, score[:, None], w)
        ids = tl.where(ks[None, :] == k, pick[:, None], ids)
    k_ok = ks < TOP_K
    if SCORING == 2:  # softmax over the k chosen logits
        e = tl.exp(w - tl.max(tl.where(k_ok[None, :], w, float("-inf")), 1)[:, None])
        e = tl.where(k_ok[None, :], e, 0.0)
        w = e / tl.sum(e, 1)[:, None]
    elif RENORMALIZE:
        total = tl.sum(tl.where(k_ok[None, :], w, 0.0), 1)
        if SCORING == 1:
            total += SIGMOID_EPS
        w = w / tl.where(row_ok, total, 1.0)[:, None]  # padded rows chose nothing: no 0 / 0
    w = w * tl.cast(scaling_factor, tl.float32)  # Inductor passes Python floats as fp64: the weights stay fp32
    out = rows.to(tl.int64)[:, None] * TOP_K + ks[None, :]
    ok = row_ok[:, None] & k_ok[None, :]
    tl.store(WEIGHTS + out, w, mask=ok)
    tl.store(IDS + out, ids.to(tl.int64), mask=ok)


def _default(experts: int, tokens: int) -> MoERoute:
    """A warp per token row, so that a row's reductions (two each of the k rounds) can stay within its warp, up
    to 4 rows a program; rows of more than 512 experts take two warps (16 fp32 values a thread). Reasoned, not
    measured."""
    block_t = min(tokens, 4)
    return MoERoute(BLOCK_T=block_t, num_warps=min(8, block_t * (2 if next_pow2(experts) > 512 else 1)))


# Eager LaunchPlans (see _launch_cache): a decoder routes the same shapes at every layer and step.
_PLANS = PlanCache()


def _route_fused(
    router_logits: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    top_k: int,
    scoring: str,
    renormalize: bool,
    scaling_factor: float,
    *,
    traced: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's ``(weights, ids)``; its positional parameters are also the schema of the op under compile."""
    T, E = router_logits.shape
    weights = torch.empty((T, top_k), device=router_logits.device, dtype=torch.float32)
    ids = torch.empty((T, top_k), device=router_logits.device, dtype=torch.int64)
    if T == 0:
        return weights, ids
    bias = weights if correction_bias is None else correction_bias  # absent: an output stands in, never read
    key = None
    if not traced:
        key = (router_logits.shape, router_logits.stride(), router_logits.dtype, router_logits.device, top_k, scoring)
        key += (renormalize, scaling_factor, None if correction_bias is None else (bias.dtype, bias.stride()))
        plan = _PLANS.get(key)
        if plan is not None and plan(router_logits, bias, weights, ids):
            return weights, ids
    T, E = int(T), int(E)  # specialized if torch.compile made them symbolic
    tokens = min(next_pow2(T), 1024)
    cfg = launch_config(
        MoERoute, router_logits.device, lambda: _default(E, tokens), experts=E, top_k=top_k, tokens=tokens
    )
    plan = launch(
        _moe_route_kernel,
        (cdiv(T, cfg.BLOCK_T),),
        # Pointers
        LOGITS=router_logits,
        BIAS=bias,
        WEIGHTS=weights,
        IDS=ids,
        # Sizes
        T=T,
        E=E,
        # Strides
        stride_lt=router_logits.stride(0),
        stride_le=router_logits.stride(1),
        stride_b=bias.stride(0),
        # Scales
        scaling_factor=float(scaling_factor),
        # Meta-parameters
        TOP_K=top_k,
        BLOCK_T=cfg.BLOCK_T,
        BLOCK_E=next_pow2(E),
        BLOCK_K=next_pow2(top_k),
        SCORING=_SCORING_CODE[scoring],
        HAS_BIAS=correction_bias is not None,
        RENORMALIZE=bool(renormalize),
        SIGMOID_EPS=_SIGMOID_RENORM_EPS,
        **cfg.options,
        traced=traced,
        plan=key is not None,
    )
    if plan is not None:
        _PLANS[key] = plan
    return weights, ids


# The op under torch.compile: no gradient, so one torch.library op (a triton_op where kernels are compiled, so
# Inductor sees the launch; an opaque custom_op under the interpreter).
def _moe_route_fake(
    router_logits: torch.Tensor,
    correction_bias: Optional[torch.Tensor],
    top_k: int,
    scoring: str,
    renormalize: bool,
    scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    T = router_logits.shape[0]
    weights = router_logits.new_empty((T, top_k), dtype=torch.float32)
    return weights, router_logits.new_empty((T, top_k), dtype=torch.int64)


def _traced_impl(*inputs):
    return _route_fused(*inputs, traced=True)


MOE_ROUTE = library_op(_OP, _traced_impl, _moe_route_fake, _schema_of(_route_fused, f"op {_OP!r}"))


def _fusable(router_logits, correction_bias, n_group, topk_group) -> bool:
    """Whether the kernel takes this call: no gradient to the logits (the kernel has no backward), no group
    limit, a dtype it loads, a row it holds, and a device Triton runs on (meta: ``tritonspec check --kernels``
    records the launch; the CPU: see ``FUSED_ON_CPU``)."""
    if torch.is_grad_enabled() and router_logits.requires_grad:
        return False
    if n_group is not None and topk_group < n_group:
        return False
    if router_logits.dtype not in _FUSED_DTYPES or router_logits.shape[1] > MAX_FUSED_EXPERTS:
        return False
    if correction_bias is not None and correction_bias.dtype not in _FUSED_DTYPES:
        return False
    device = router_logits.device.type
    if device == "cpu":
        return FUSED_ON_CPU and triton_runs(device)
    return device == "meta" or triton_runs(device)


def moe_route(
    router_logits: torch.Tensor,
    top_k: int,
    *,
    scoring: str = "softmax",
    renormalize: bool = True,
    correction_bias: torch.Tensor | None = None,
    n_group: int | None = None,
    topk_group: int | None = None,
    scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights, ids)`` of the ``top_k`` experts each token is routed to.

    ``router_logits`` is (tokens, experts), any floating dtype; the math runs in float32. ``weights`` is
    (tokens, top_k) float32, differentiable with respect to ``router_logits`` (the router's gradient
    flows through it); ``ids`` is (tokens, top_k) int64, the chosen experts, chosen by ``torch.topk``
    (whose tie order they keep) on the values the Hugging Face router ranks. Calls without gradient or
    group limit on a GPU take the fused kernel (see the module's doc): the same within float32 rounding,
    ties to the lower expert index.

    ``scoring`` says how logits become scores and weights:

    - ``"softmax"``: softmax over all experts, top-k of the probabilities, weights are those
      probabilities (divided by their sum if ``renormalize``). Qwen2-MoE, Qwen3-MoE and OLMoE
      (``renormalize=config.norm_topk_prob``), Mixtral (``renormalize=True``).
    - ``"topk_softmax"``: top-k of the logits, weights are the softmax over the k chosen logits
      (they sum to 1: ``renormalize`` has no effect). GPT-OSS. Not bit-equal to softmax then
      renormalize, which rounds differently (Mixtral).
    - ``"sigmoid"``: independent sigmoid scores; weights are the chosen experts' scores (divided by
      their sum plus 1e-20 if ``renormalize``). DeepSeek-V3 (``renormalize=config.norm_topk_prob``,
      ``correction_bias=gate.e_score_correction_bias``, ``n_group``, ``topk_group``,
      ``scaling_factor=config.routed_scaling_factor``). Its ids come in ``torch.topk(sorted=False)``'s
      order, as in that router (the order is the implementation's; a MoE layer's output does not depend
      on it), the fused kernel's by descending biased score; the other scorings' ids are sorted by
      descending score.

    ``correction_bias`` (experts,) is added to the scores for choosing only: the weights stay the
    unbiased scores. ``n_group``/``topk_group`` limit each token to its ``topk_group`` best of
    ``n_group`` equal groups of consecutive experts, a group scored by the sum of its two best biased
    scores. ``scaling_factor`` multiplies the weights last.

    The weights are float32 even where a router casts them back to the logits' dtype (the Qwen-MoE and
    OLMoE routers do) or runs topk_softmax in it (GPT-OSS): cast them where the experts need it.
    """
    _check(router_logits, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor)
    if _fusable(router_logits, correction_bias, n_group, topk_group):
        args = (router_logits, correction_bias, top_k, scoring, renormalize, float(scaling_factor))
        if use_library_op():
            return MOE_ROUTE(*args)
        return _route_fused(*args, traced=False)
    logits = router_logits.float()
    if scoring == "softmax":
        scores = torch.softmax(logits, dim=-1)
    elif scoring == "sigmoid":
        scores = logits.sigmoid()
    else:  # topk_softmax: choose on the logits themselves
        scores = logits
    # The choice takes no gradient (only the indices of its top-k are used): build it outside the graph.
    choice = scores.detach()
    if correction_bias is not None:
        choice = choice + correction_bias.float()
    if n_group is not None and topk_group < n_group:
        choice = _keep_top_groups(choice, n_group, topk_group)
    ids = torch.topk(choice, top_k, dim=-1, sorted=scoring != "sigmoid")[1]
    weights = scores.gather(1, ids)
    if scoring == "topk_softmax":
        weights = torch.softmax(weights, dim=-1)
    elif renormalize:
        denominator = weights.sum(dim=-1, keepdim=True)
        if scoring == "sigmoid":
            denominator = denominator + _SIGMOID_RENORM_EPS
        weights = weights / denominator
    if scaling_factor != 1.0:  # x * 1.0 is x, gradient included: skip the kernel
        weights = weights * scaling_factor
    return weights, ids
