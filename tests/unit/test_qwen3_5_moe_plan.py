"""Qwen3.5-MoE without a process group: the tiny config, the TP plan (shared expert sharded like
an MLP, router / routed experts / shared-expert gate replicated), the layout checks, the presets'
published sizes, and the driver taking packing for the recurrent families (refusing it, by the
key's name, for a family that cannot pack)
(the distributed exactness: tests/distributed/test_qwen3_5_moe.py)."""

from __future__ import annotations

import pytest

from ray_dhp import demo
from ray_dhp.models import FAMILIES, build_model

FAMILY = "qwen3_5_moe"


def test_tiny_config_has_the_sparse_block_of_every_layer():
    config = demo.tiny_model_config(FAMILY)
    tc = config.text_config
    assert tc.num_experts >= 8 and tc.num_experts_per_tok == 2 and tc.router_aux_loss_coef > 0
    assert tc.layer_types == ["linear_attention", "full_attention"]
    model = build_model(config)
    names = {n for n, _ in model.named_parameters()}
    for i in range(tc.num_hidden_layers):
        for part in ("gate.weight", "experts.gate_up_proj", "experts.down_proj",
                     "shared_expert.gate_proj.weight", "shared_expert_gate.weight"):
            assert f"model.language_model.layers.{i}.mlp.{part}" in names
    assert FAMILIES[FAMILY].moe.sparse_layers(tc) == list(range(tc.num_hidden_layers))
    assert demo.tiny_processor(FAMILY) is not None


def test_plan_shards_the_shared_expert_and_replicates_the_routed_part():
    """`ray-dhp plan` classifies parameters by the TP plan: the shared expert's projections are
    sharded; the router, the routed experts, the shared-expert gate, the linear-attention
    parameters seen through the rank's channels and every norm are held whole."""
    from ray_dhp.models.sizes import count_params

    config = demo.tiny_model_config(FAMILY)
    spec = FAMILIES[FAMILY]
    whole = spec.tp_partial_grad_suffixes + ("layernorm.weight", "language_model.norm.weight",
                                             "mlp.gate.weight", "mlp.experts.gate_up_proj",
                                             "mlp.experts.down_proj", "mlp.shared_expert_gate.weight")
    text = {n: p.numel() for n, p in build_model(config).named_parameters()
            if not n.startswith("model.visual.")}
    counts = count_params(config)
    assert counts.text == sum(text.values())
    assert counts.text_sharded == sum(v for n, v in text.items() if not n.endswith(whole))
    assert any(n.endswith("shared_expert.down_proj.weight") for n in text)
    experts = sum(q.numel for q in counts.text_sizes if q.expert)
    assert experts == sum(v for n, v in text.items() if ".mlp.experts." in n)


def test_layout_checks_name_the_shared_expert_and_the_experts():
    spec = FAMILIES[FAMILY]
    config = demo.tiny_model_config(FAMILY)
    spec.validate_layout(config, sp=2, tp=4)
    spec.validate_expert_parallel(config, 8)
    config.text_config.shared_expert_intermediate_size = 66
    with pytest.raises(ValueError, match=r"shared expert intermediate size \(66\)"):
        spec.validate_layout(config, sp=1, tp=4)
    with pytest.raises(ValueError, match=r"text.expert_parallel=3 must divide the number of experts"):
        spec.validate_expert_parallel(config, 3)
    spec.validate_layout(demo.tiny_model_config(FAMILY), sp=1, tp=2, text_sp=True)  # text SP covered


@pytest.mark.parametrize("preset, total", [
    ("35b-a3b", 35.11),
    pytest.param("122b-a10b", 122.56, marks=pytest.mark.slow),  # meta builds of 256-512 experts
    pytest.param("397b-a17b", 396.8, marks=pytest.mark.slow),   # x 48-60 layers: seconds each
])
def test_presets_have_the_published_sizes(preset, total):
    """Meta-device counts of the presets: the released models' names (35B, 122B, 397B total;
    transformers drops the checkpoints' multi-token-prediction layer, which is not counted)."""
    from transformers import AutoConfig

    from ray_dhp.cli.presets import preset_dims
    from ray_dhp.models.sizes import count_params

    dims = preset_dims(FAMILY, preset)
    config = AutoConfig.for_model(dims.pop("model_type"), **dims)
    FAMILIES[FAMILY].validate_layout(config, sp=2, tp=2)  # 2 KV heads: TP <= 2
    counts = count_params(config)
    assert round((counts.vision + counts.text) / 1e9, 2) == total


@pytest.mark.parametrize("family", ["qwen3_5", FAMILY, "qwen2_5_omni", "qwen3_omni_moe"])
def test_driver_takes_packing_and_refuses_it_where_it_cannot(family, tmp_path, monkeypatch):
    """The recurrent families pack (their Gated DeltaNet layers run one row per packed sample,
    tests/distributed/test_packing.py), so do the Qwen-Omni thinkers (their own
    get_rope_index, tests/distributed/test_omni_packing.py); a family that cannot pack fails in
    the driver naming the key, from a run file (``data.packing``) or the Python API
    (``train_loop_config.packing``), before any worker starts. Every family of the demo packs
    now (MiniCPM-V 4.7 since its get_rope_index is called with the arguments its signature
    names, `ray_dhp.models.generic_packing`), so the refused one is LLaVA's family with the
    refusal `packing_rule` gives a get_rope_index that needs an argument a sample lacks."""
    from dataclasses import replace

    import ray.train

    import ray_dhp.models as models
    from ray_dhp import DHPConfig
    from ray_dhp.models.generic_packing import rope_index_refusal
    from ray_dhp.run_file import load_run_file
    from ray_dhp.train.trainer import DisaggregatedTrainer

    load_run_file(None, [f"model.demo={family}", "data.packing=true"]).validate()
    refused = "llava"
    reason = rope_index_refusal(lambda self, input_ids, image_grid_thw, audio_seqlens: None)
    monkeypatch.setitem(models._BY_MODEL_TYPE, refused, replace(
        models.family_of(demo.tiny_model_config(refused)), packing=False, packing_reason=reason))
    with pytest.raises(ValueError, match=rf"data.packing=true is not covered for the {refused} "):
        load_run_file(None, [f"model.demo={refused}", "data.packing=true"]).validate()
    data = tmp_path / "data.jsonl"  # the datasets are checked first: one that exists
    data.write_text("")
    dhp = DHPConfig(model=demo.tiny_model_config(refused), processor=demo.tiny_processor(refused))
    with pytest.raises(ValueError, match=r"set train_loop_config.packing=false"):
        DisaggregatedTrainer(dhp_config=dhp, train_loop_config={"packing": True},
                             datasets={"train": str(data)},
                             scaling_config=ray.train.ScalingConfig(num_workers=1))
