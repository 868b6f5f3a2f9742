"""DeepSeek routers (inference process, every MoE layer's router when the config asks): V2 groups, V3 noaux_tc.

V2 ("group_limited_greedy"): experts sit in `num_groups` equal groups; a token keeps only the experts of its
`topk_groups` best groups (a group scores its best expert), and its top-k is then taken among those, as
transformers' `DeepseekV2TopkRouter` does it. V3 (`noaux_tc`): sigmoid scores; the choice (groups
scored by the sum of their two best, then the top-k) is made on the scores plus the per-expert
`e_score_correction_bias`, while the weights are the unbiased scores of the chosen experts, as transformers'
`DeepseekV3TopkRouter`. Pure tensor math: no host sync, CUDA-graph safe; decides nothing else.
"""

from __future__ import annotations

import torch


def group_limited(probs: torch.Tensor, num_groups: int, topk_groups: int) -> torch.Tensor:
    """probs [T, E] float32 -> the same with every expert outside the token's best groups set to 0."""
    t, e = probs.shape
    groups = probs.view(t, num_groups, e // num_groups)  # [T, G, E/G]
    best = groups.amax(-1).topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=probs.device).scatter_(1, best, True)  # [T, G]
    return (groups * keep.unsqueeze(-1)).view(t, e)  # [T, E]


def noaux_tc(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, num_groups: int, topk_groups: int,
             out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] float32 -> (weights [T, k] float32: unnormalized sigmoid scores, ids [T, k] int64).

    out: (weights, ids) buffers written in place (a CUDA graph's static buffers)."""
    t, e = logits.shape
    scores = logits.sigmoid()  # [T, E]
    choice = scores if bias is None else scores + bias  # [T, E]
    per_group = choice.view(t, num_groups, e // num_groups)  # [T, G, E/G]
    group_scores = per_group.topk(min(2, e // num_groups), dim=-1).values.sum(-1)  # [T, G]
    best = group_scores.topk(topk_groups, dim=-1).indices  # [T, topk_groups]
    keep = torch.zeros(t, num_groups, dtype=torch.bool, device=logits.device).scatter_(1, best, True)  # [T, G]
    masked = per_group.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(t, e)  # [T, E]
    if out is None:
        ids = masked.topk(top_k, dim=-1).indices  # [T, k]
        return scores.gather(1, ids), ids
    w, ids = out
    torch.topk(masked, top_k, dim=-1, out=(w, ids))
    torch.gather(scores, 1, ids, out=w)
    return w, ids
