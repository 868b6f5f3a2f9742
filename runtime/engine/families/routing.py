"""DeepSeek-V2's group-limited routing (inference process, every MoE layer's router when the config asks).

Experts sit in `num_groups` equal groups; a token keeps only the experts of its `topk_groups` best groups (a
group scores its best expert), and its top-k is then taken among those. As transformers' `DeepseekV2TopkRouter`
does it ("group_limited_greedy"). Pure tensor math: no host sync, CUDA-graph safe; decides nothing else.
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
