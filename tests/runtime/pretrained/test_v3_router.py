"""DeepSeek-V3's router (noaux_tc) picks the experts and weights transformers' `DeepseekV3TopkRouter` picks.

Random rows and a random e_score_correction_bias large enough to change choices; also through the static
`out` buffers a CUDA graph's rows use (the MLA checkpoints in the parity tests decode eagerly, without them).
"""

from __future__ import annotations

import pytest
import torch

from tierplan.runtime.engine.config import ModelSpec
from tierplan.runtime.engine.moe import route
from tierplan.runtime.engine.presets import preset

transformers = pytest.importorskip("transformers")
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter  # noqa: E402


def _spec(norm: bool) -> ModelSpec:
    return preset("tiny").with_(num_experts=16, top_k=4, num_expert_groups=4, topk_groups=2, router_scoring="sigmoid",
                                norm_topk_prob=norm, routed_scaling_factor=2.5, dtype="float32")


@pytest.mark.parametrize("norm", [True, False])
def test_noaux_tc_matches_transformers(norm: bool) -> None:
    spec = _spec(norm)
    torch.manual_seed(0)
    cfg = transformers.DeepseekV3Config(hidden_size=spec.hidden_size, n_routed_experts=16, num_experts_per_tok=4,
                                        n_group=4, topk_group=2, norm_topk_prob=norm, routed_scaling_factor=2.5)
    ref = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_(0, 0.2)
        ref.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, spec.hidden_size)  # [T, H]
    with torch.no_grad():
        _, ref_w, ref_ids = ref(x)
    order = ref_ids.argsort(-1)
    ref_ids, ref_w = ref_ids.gather(1, order), ref_w.gather(1, order)  # transformers' top-k is unsorted
    unbiased = route(x, ref.weight.detach(), spec)[0]
    out = (torch.empty(64, 4), torch.empty(64, 4, dtype=torch.int64))
    for ids, w in (route(x, ref.weight.detach(), spec, bias=ref.e_score_correction_bias),
                   route(x, ref.weight.detach(), spec, out=out, bias=ref.e_score_correction_bias)):
        o = ids.argsort(-1)
        assert torch.equal(ids.gather(1, o), ref_ids)
        assert torch.allclose(w.gather(1, o), ref_w, atol=1e-6, rtol=0)
    assert not torch.equal(unbiased.sort(-1).values, ref_ids)  # the bias really changes choices here
