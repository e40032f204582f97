"""A generic family's Megatron text sequence parallelism is derived from its LM's own
``base_model_tp_plan`` and module tree (`ray_dhp.models.text_sp_plans`), or refused in the driver
with the reason. The plans' fp64 parity is the ``*-collocated-dp2-tp2-text-sp`` rows of
`tests/distributed/test_families.py`."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import family_of


def _kinds(config) -> dict:
    plan = family_of(config).text_sp_plan(config.get_text_config())
    return {k.removeprefix("model.language_model."): type(v).__name__ for k, v in plan.items()}


def test_text_sp_is_derived_from_the_plan_or_refused_with_the_reason():
    """Gemma 3: its four per-block norms on the local tokens, both regions Megatron (saved-shard
    column-parallel projections), the final norm after the layers. LFM2 (only its embedding in
    the plan, a short convolution in its layers) refused, and the driver says why."""
    import dataclasses

    from transformers import AutoConfig

    from ray_dhp.models.text_sp_plans import sp_layout

    gemma = _kinds(demo.tiny_model_config("gemma3"))
    norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
             "post_feedforward_layernorm")
    assert all(gemma[f"layers.*.{n}"] == "SequenceParallel" for n in norms)
    assert gemma["layers.*.self_attn"] == gemma["layers.*.mlp"] == "GatheredColwise"
    assert gemma["layers.0"] == "ShardSequence" and gemma["norm"] == "AfterLayers"
    assert gemma["lm_head"] == "GatheredColwise"
    tc = AutoConfig.for_model("lfm2", num_hidden_layers=2)
    with torch.device("meta"):
        from transformers import AutoModel

        lm = AutoModel.from_config(tc)
    layout, why = sp_layout(lm, dict(tc.base_model_tp_plan), (), tc.hidden_size)
    assert layout is None and "shards nothing in the decoder layers" in why
    config = demo.tiny_model_config("llava")
    family = dataclasses.replace(family_of(config), text_sp_refusal=why)
    family.validate_layout(config, sp=1, tp=2)  # text TP alone is fine
    with pytest.raises(ValueError, match="text sequence_parallel=true is not covered for "
                                         "'llava': its base_model_tp_plan shards nothing"):
        family.validate_layout(config, sp=1, tp=2, text_sp=True)


@pytest.mark.slow
def test_the_matrix_runs_text_sp_for_every_generic_family_that_admits_it():
    """`family_rows.GENERIC_NO_TEXT_SP` is exactly the generic families whose plan refuses it
    (LFM2-VL refused in the driver); GLM-4V's MLP (a fused ``gate_up_proj`` the forward chunks
    whole) runs on the gathered sequence."""
    from tests.distributed.family_rows import GENERIC_NO_TEXT_SP
    from tests.distributed.parity import GENERIC_FAMILIES

    refused = {f: family_of(demo.tiny_model_config(f)).text_sp_refusal for f in GENERIC_FAMILIES}
    assert {f for f, why in refused.items() if why} == set(GENERIC_NO_TEXT_SP), refused
    glm = _kinds(demo.tiny_model_config("glm4v"))
    assert glm["layers.*.mlp"] == "GatheredRegion" and glm["layers.*.self_attn"] == "GatheredColwise"
    config = demo.tiny_model_config("lfm2_vl")
    with pytest.raises(ValueError, match="text sequence_parallel=true is not covered for "
                                         "'lfm2_vl': its base_model_tp_plan shards nothing"):
        family_of(config).validate_layout(config, sp=1, tp=2, text_sp=True)


class _Layer(torch.nn.Module):
    def forward(self, hidden_states):
        return hidden_states


def _guard_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    from ray_dhp.parallel.seq_gather import AfterLayers, LayersDone, ShardSequence

    mesh = init_device_mesh("cpu", (world,))
    marker = LayersDone()
    norm = AfterLayers(marker)._apply(torch.nn.LayerNorm(4), mesh)
    first = ShardSequence(input_kwarg="hidden_states", marker=marker)._apply(_Layer(), mesh)
    x = torch.randn(1, 2 * world, 4)
    try:
        norm(x)
        before = "ran"
    except RuntimeError as e:
        before = str(e)
    shard = first(hidden_states=x)
    after = tuple(norm(shard).shape)
    try:  # the next forward's norm before the layers again: the marker was reset
        norm(x)
        again = "ran"
    except RuntimeError as e:
        again = str(e)
    return before, after, again


@pytest.mark.slow
def test_a_final_norm_the_model_calls_before_the_layers_is_refused():
    """`AfterLayers`: the LM-level norm runs on the shard only after the sharded layers; called on
    the whole sequence (a norm before the layers) it raises instead of summing its gradient over
    ranks that each saw every token."""
    from tests.spawn import run_on_ranks

    for before, after, again in run_on_ranks(_guard_body, 2):
        assert "runs before the sequence-sharded decoder layers" in before
        assert after == (1, 2, 4) and "runs before" in again
