"""Per-module training choices (`ray_dhp.config.tuning`, `ray_dhp.models.tuning`): parsing, the
driver's errors (naming the key, from Python and from the run file), the optimizer's groups,
and the plan's bytes."""

from __future__ import annotations

import pytest

from ray_dhp import demo
from ray_dhp.config.checks import ConfigError
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.config.tuning import parse_tuning
from ray_dhp.models.tuning import module_of, trains


@pytest.mark.parametrize("modules, match", [
    ({"visoin": {"train": False}}, r"train_loop_config\.modules\.visoin: unknown module; did you mean 'vision'"),
    ({"merger": {"learning_rate": 1e-4}}, r"train_loop_config\.modules\.merger\.learning_rate: unknown key; known: \[.train., .lr."),
    ({"vision": {"lr": 0}}, r"train_loop_config\.modules\.vision\.lr: expected a finite number > 0"),
    ({"vision": {"train": "no"}}, r"train_loop_config\.modules\.vision\.train: expected true or false"),
    ({"vision": {"train": False}, "merger": {"train": False}, "llm": {"train": False}},
     r"train_loop_config\.modules: every module is frozen"),
    ({"llm": {"train": False, "lora": {"r": 8}}},
     r"train_loop_config\.modules\.llm\.lora contradicts train_loop_config\.modules\.llm\.train=false"),
    ({"vision": {"lora": {"r": 8}}}, r"modules\.vision\.lora: LoRA adapters go on the language model only"),
    ({"llm": {"lora": {"r": 0}}}, r"modules\.llm\.lora\.r: the adapter rank must be an integer >= 1"),
    ({"llm": {"lora": {"rank": 8}}}, r"modules\.llm\.lora\.rank: unknown key"),
    ({"llm": {"lora": {"target_modules": ["qkv"]}}}, r"modules\.llm\.lora\.target_modules: \['qkv'\]"),
    ("vision", r"train_loop_config\.modules: expected null or dict"),
])
def test_bad_choices_fail_naming_the_key(modules, match):
    with pytest.raises(ConfigError, match=match):
        TrainLoopConfig(modules=modules)


def test_run_file_names_its_own_keys_and_refuses_lora_with_text_sp():
    from ray_dhp.run_file import load_run_file

    with pytest.raises(ConfigError, match=r"^optim\.modules\.visoin: unknown module"):
        load_run_file("examples/tiny.yaml", ["optim.modules={visoin: {train: false}}"])
    with pytest.raises(ConfigError, match=r"optim\.modules\.llm\.lora: LoRA adapters are not "
                                          r"covered with text sequence parallelism"):
        load_run_file("examples/tiny.yaml", ["optim.modules={llm: {lora: {r: 4}}}",
                                             "text.sequence_parallel=true"])
    rf = load_run_file("examples/tiny.yaml", ["optim.modules={vision: {train: false}, merger: {lr: 1e-4}}"])
    t = parse_tuning(rf.train_loop_config()["optim"]["modules"])  # YAML reads 1e-4 as a string: coerced
    assert (t.choice("vision").train, t.choice("merger").lr, t.choice("llm").train) == (False, 1e-4, True)


def test_modules_of_parameter_names():
    assert module_of("model.visual.blocks.0.attn.qkv.weight") == "vision"
    assert module_of("model.visual.patch_embed.proj.weight") == "vision"
    assert module_of("model.visual.merger.mlp.0.weight") == "merger"
    assert module_of("model.visual.deepstack_merger_list.1.norm.weight") == "merger"  # Qwen3-VL
    assert module_of("model.language_model.layers.0.mlp.up_proj.weight") == "llm"
    assert module_of("lm_head.weight") == "llm"
    t = parse_tuning({"llm": {"lora": True}})
    assert trains(t, "model.visual.blocks.0.attn.qkv.weight")
    assert not trains(t, "model.language_model.layers.0.self_attn.q_proj.base_layer.weight")
    assert trains(t, "model.language_model.layers.0.self_attn.q_proj.lora_A.default.weight")


def test_optimizer_groups_per_module():
    """Each module's lr and weight decay; norms and biases without decay; frozen parameters in
    no group; the base lr's groups carry no lr of their own (the optimizer's default)."""
    from ray_dhp.models import build_model
    from ray_dhp.step.optim import build_optimizer
    from ray_dhp.config.tuning import tuning_of
    from ray_dhp.models.tuning import freeze

    cfg = TrainLoopConfig(lr=1e-3, weight_decay=0.1, modules={
        "vision": {"train": False}, "merger": {"lr": 5e-4, "weight_decay": 0.0}})
    model = build_model(demo.tiny_model_config("qwen2_5_vl"), seed=0)
    freeze(model, tuning_of(cfg.optim))
    opt, _ = build_optimizer(model.named_parameters(), cfg.optim)
    by_id = {id(p): n for n, p in model.named_parameters()}
    seen = {}
    for g in opt.param_groups:
        for p in g["params"]:
            seen[by_id[id(p)]] = (g["lr"], g["weight_decay"])
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(module_of(n) == "vision" for n in frozen)
    assert not frozen & set(seen)
    assert set(seen) | frozen == set(by_id.values())
    for n, (lr, wd) in seen.items():
        if module_of(n) == "merger":
            assert (lr, wd) == (5e-4, 0.0), n
        else:
            p = dict(model.named_parameters())[n]
            assert (lr, wd) == (1e-3, 0.1 if p.ndim >= 2 else 0.0), n


def test_plan_counts_frozen_parts_as_weights_only():
    """`rank_state`: a frozen LLM costs only its weights; LoRA adds the adapters (trained) and
    keeps the base frozen."""
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES
    from ray_dhp.parallel.topology import Topology

    config = demo.tiny_model_config("qwen2_5_vl")
    topo = Topology.build(placement="collocated", vision_sp=2, vision_dp=1, text_tp=2, text_dp=1)
    policy = POLICIES["bf16_mixed"]
    full = rank_state(count_params(config), topo, 0, policy)  # vision ZeRO-1: the default
    frozen = rank_state(count_params(config, parse_tuning({"llm": {"train": False}})), topo, 0,
                        policy)
    counts = count_params(config)
    t = counts.text_per_rank(2)
    assert frozen.weights == full.weights
    assert full.total - frozen.total == t * (policy.state_bytes() - policy.weight_bytes())
    lora = count_params(config, parse_tuning({"llm": {"lora": {"r": 4}}}))
    assert lora.text > counts.text and lora.text_frozen == counts.text


def test_resume_needs_the_same_trained_modules():
    from ray_dhp.config.tuning import same_structure

    assert same_structure(None, {"merger": {"lr": 1e-4}}) == ""  # rates may change
    assert "vision" in same_structure(None, {"vision": {"train": False}})
    assert "LoRA" in same_structure({"llm": {"lora": {"r": 4}}}, {"llm": {"lora": {"r": 8}}})
