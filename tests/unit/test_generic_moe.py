"""A generic family's mixture-of-experts language model is read from transformers' own metadata
(`ray_dhp.models.generic_moe`), and the tiny copies (`ray_dhp.models.shrink`) keep a sparse layer
with few experts. No process group; the language models are built on the meta device."""

from __future__ import annotations

import dataclasses

import pytest
import transformers
from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoConfig

from ray_dhp import demo
from ray_dhp.models import family_of
from ray_dhp.models.generic_moe import dense_plan, expert_count, moe_spec
from ray_dhp.models.shrink import tiny_config


def _spec(model_type: str, lm_class: str):
    config = tiny_config(AutoConfig.for_model(model_type))
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    return config, moe_spec(cls, config, getattr(transformers, lm_class))


def test_glm4v_moe_is_read_from_its_own_metadata():
    config = AutoConfig.for_model("glm4v_moe")  # the published GLM-4.5V dims (meta only)
    moe = family_of(config).moe
    assert (moe.router_suffix, moe.experts_suffix, moe.router_output) == ("mlp.gate", "mlp.experts", 0)
    # first_k_dense_replace=1: layer 0 dense, the other 45 sparse
    assert moe.sparse_layers(config.text_config) == list(range(1, 46))
    assert moe.aux_loss and not moe.ep_refusal
    assert getattr(config.text_config, moe.experts_key) == 128


def test_the_experts_leave_the_tp_plan_and_the_shared_experts_stay():
    config = demo.tiny_model_config("glm4v_moe")
    family = family_of(config)
    assert not family.text_plan_refusal  # packed_colwise / moe_tp_experts were the experts'
    plan = family.text_tp_plan(config.text_config)
    assert not any(".mlp.experts" in k for k in plan)
    assert any(k.endswith("mlp.shared_experts.down_proj") for k in plan)
    hf = {"layers.*.mlp.experts.gate_up_proj": "packed_colwise", "layers.*.mlp.experts": "moe_tp_experts",
          "layers.*.mlp.experts_x": "colwise", "layers.*.mlp.up_proj": "colwise"}
    assert dense_plan(hf, ("layers.*.mlp.experts",)) == {"layers.*.mlp.experts_x": "colwise",
                                                        "layers.*.mlp.up_proj": "colwise"}


def test_a_forward_without_a_router_loss_trains_without_one():
    """DeepSeek-V3's LM (Kimi-K2.5's): auxiliary-loss-free routing, no ``output_router_logits``
    in the stock forward: no load-balancing loss; its experts take expert parallelism."""
    config, (moe, _) = _spec("kimi_k25", "DeepseekV3Model")
    assert not moe.aux_loss and not moe.ep_refusal
    assert moe.sparse_layers(config.get_text_config()) == [1]  # first_k_dense_replace -> 1


def test_experts_of_another_layout_refuse_expert_parallelism_with_the_reason():
    """Llama 4's experts are transposed ``[E, H, 2I]`` and take pre-scaled tokens: EP refused
    (driver, planner), the experts stay replicated."""
    config, (moe, _) = _spec("llama4", "Llama4TextModel")
    assert "Llama4TextExperts" in moe.ep_refusal and moe.router_suffix == "feed_forward.router"
    family = dataclasses.replace(family_of(demo.tiny_model_config("glm4v_moe")), moe=moe)
    with pytest.raises(ValueError, match="text.expert_parallel=2 is not covered.*Llama4TextExperts"):
        family.validate_expert_parallel(config, 2)


def test_tiny_copies_trim_per_layer_lists_and_shrink_the_experts():
    """Llama 4's ``no_rope_layers`` / ``moe_layers`` (48 entries) are cut to the 2 tiny layers
    (its config class refused the copy before); experts 4, top-k at most 2, the first layer the
    only dense one (Kimi's 3 dense layers would leave none sparse)."""
    llama = tiny_config(AutoConfig.for_model("llama4")).get_text_config()
    assert (len(llama.no_rope_layers), llama.moe_layers, expert_count(llama)) == (2, [0, 1], 4)
    assert llama.num_experts_per_tok == 1
    kimi = tiny_config(AutoConfig.for_model("kimi_k25"))
    tc = kimi.get_text_config()
    assert (expert_count(tc), tc.num_experts_per_tok, tc.first_k_dense_replace, tc.n_group) == (4, 2, 1, 1)
    assert kimi._experts_implementation == "eager"  # grouped_mm has no fp64 kernel


@pytest.mark.slow
def test_ernie_tiny_copy_keeps_its_rope_and_router_reads():
    """ERNIE-4.5-VL (`ray_dhp.models.shrink`, `ray_dhp.models.moe`, `ray_dhp.models.generic`):
    its config leaves ``mrope_section`` to the modeling code (default 22:22:20, h and w
    interleaved, so equal), which the tiny copy scales to its 16-wide head (3:3:2, not Qwen's
    proportion 2:3:3, which its rotary cannot split); its dense layer's ``mlp`` (named like the
    sparse layers' router block) is no router; the gate statistics its class makes with
    ``requires_grad=False`` and the experts its text forward never reaches are held frozen."""
    import torch

    from ray_dhp.models.moe import RouterTap

    config = demo.tiny_model_config("ernie4_5_vl_moe")
    assert config.get_text_config().rope_parameters["mrope_section"] == [3, 3, 2]
    family = family_of(config)
    sparse = family.moe.sparse_layers(config.text_config)
    assert sparse == [1] and family.moe.router_suffix == "mlp"
    with torch.device("meta"):
        model = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]._from_config(config)
    lm = family.language_model(model)
    assert RouterTap(lm, family.moe, sparse).routers == [lm.layers[1].mlp]
    fixed = set(family.fixed_params)  # held frozen: the statistics, and the vision experts its
    # text forward never calls without moe_mm_token_type_ids (which the engine does not pass)
    assert fixed == {f"language_model.layers.1.mlp.{m}" for m in (
        "text_moe.gate.moe_statics.e_score_correction_bias", "vision_moe.gate.weight",
        "vision_moe.gate.moe_statics.e_score_correction_bias", "vision_moe.experts.gate_up_proj",
        "vision_moe.experts.down_proj")}
    assert fixed <= set(family.vision_encoder.unused)
