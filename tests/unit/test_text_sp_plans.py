"""A generic family's Megatron text sequence parallelism is derived from its LM's own
``base_model_tp_plan`` and module tree (`ray_dhp.models.text_sp_plans`), or refused in the driver
with the reason. The plans' fp64 parity is the ``*-collocated-dp2-tp2-text-sp`` rows of
`tests/distributed/test_families.py`."""

from __future__ import annotations

import pytest

from ray_dhp import demo
from ray_dhp.models import family_of


def _kinds(config) -> dict:
    plan = family_of(config).text_sp_plan(config.get_text_config())
    return {k.removeprefix("model.language_model."): type(v).__name__ for k, v in plan.items()}


def test_text_sp_is_derived_from_the_plan_or_refused_with_the_reason():
    """Gemma 3: its four per-block norms on the local tokens, both regions Megatron (saved-shard
    column-parallel projections), the final norm after the layers; GLM-4V's MLP (a fused
    ``gate_up_proj`` the forward chunks whole) on the gathered sequence; LFM2-VL refused."""
    gemma = _kinds(demo.tiny_model_config("gemma3"))
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    assert all(gemma[f"layers.*.{n}"] == "SequenceParallel" for n in norms)
    assert gemma["layers.*.self_attn"] == gemma["layers.*.mlp"] == "GatheredColwise"
    assert gemma["layers.0"] == "ShardSequence" and gemma["norm"] == "AfterLayers"
    assert gemma["lm_head"] == "GatheredColwise"
    glm = _kinds(demo.tiny_model_config("glm4v"))
    assert glm["layers.*.mlp"] == "GatheredRegion" and glm["layers.*.self_attn"] == "GatheredColwise"
    config = demo.tiny_model_config("lfm2_vl")
    family_of(config).validate_layout(config, sp=1, tp=2)  # text TP alone is fine
    with pytest.raises(ValueError, match="text sequence_parallel=true is not covered for "
                                         "'lfm2_vl': its base_model_tp_plan shards nothing"):
        family_of(config).validate_layout(config, sp=1, tp=2, text_sp=True)


@pytest.mark.slow
def test_the_matrix_runs_text_sp_for_every_generic_family_that_admits_it():
    """`family_rows.GENERIC_NO_TEXT_SP` is exactly the generic families whose plan refuses it."""
    from tests.distributed.family_rows import GENERIC_NO_TEXT_SP
    from tests.distributed.parity import GENERIC_FAMILIES

    refused = {f: family_of(demo.tiny_model_config(f)).text_sp_refusal for f in GENERIC_FAMILIES}
    assert {f for f, why in refused.items() if why} == set(GENERIC_NO_TEXT_SP), refused
