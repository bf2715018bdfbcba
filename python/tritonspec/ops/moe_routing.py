"""The router of Mixture-of-Experts layers: which experts each token goes to, and with what weights.

One function, ``moe_route``, covers the routers of the Hugging Face MoE families by its arguments
(Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral, GPT-OSS, DeepSeek-V3); it picks the same experts in the same
order and computes the same weights as their routers, since it runs the same torch ops in the same
order: a reordered sum or a top-k over other values would flip near-ties and move weights by an ulp.

The math is float32 whatever the logits' dtype: in bfloat16 near-equal scores round together and the
chosen experts change (vLLM runs DeepSeek's router in float32 for that reason). Pure torch with no
host synchronization and no data-dependent shapes, so it is CUDA-graph capturable and traces under
``torch.compile(fullgraph=True)``; the weights are differentiable with respect to the logits.

What comes after it is the experts' (:mod:`tritonspec.ops.moe`): they sort the chosen (token, expert)
pairs by expert (:mod:`tritonspec.ops.moe_sort`) and run the grouped GEMMs.
"""

from __future__ import annotations

import torch

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
    (whose tie order they keep) on the values the Hugging Face router ranks.

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
      on it); the other scorings' ids are sorted by descending score.

    ``correction_bias`` (experts,) is added to the scores for choosing only: the weights stay the
    unbiased scores. ``n_group``/``topk_group`` limit each token to its ``topk_group`` best of
    ``n_group`` equal groups of consecutive experts, a group scored by the sum of its two best biased
    scores. ``scaling_factor`` multiplies the weights last.

    The weights are float32 even where a router casts them back to the logits' dtype (the Qwen-MoE and
    OLMoE routers do) or runs topk_softmax in it (GPT-OSS): cast them where the experts need it.
    """
    _check(router_logits, top_k, scoring, correction_bias, n_group, topk_group, scaling_factor)
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
