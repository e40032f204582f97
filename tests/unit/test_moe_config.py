"""Mixture-of-experts: the tiny config, the driver's errors naming ``text.expert_parallel``, the
run-file key, the EP group layout and the load-balancing loss against transformers' own
function (the distributed exactness: tests/distributed/test_moe.py)."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.layout import DHPConfig, ModuleParallel
from ray_dhp.models.moe import aux_contribution
from ray_dhp.parallel.expert import edp_groups, ep_groups
from ray_dhp.parallel.topology import Topology


def test_presets_have_the_published_sizes():
    from transformers import AutoConfig

    from ray_dhp.cli.presets import preset_dims
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import POLICIES

    dims = preset_dims("qwen3_vl_moe", "30b-a3b")
    config = AutoConfig.for_model(dims.pop("model_type"), **dims)
    counts = count_params(config)
    assert round((counts.vision + counts.text) / 1e9, 2) == 31.07  # the model card's 31.07B
    experts = sum(q.numel for q in counts.text_sizes if q.expert)
    topo = lambda ep: Topology.build(placement="collocated", vision_dp=8, vision_sp=1, text_dp=8,
                                     text_tp=1, text_ep=ep)
    one, eight = (rank_state(counts, topo(ep), 0, POLICIES["bf16_mixed"]) for ep in (1, 8))
    assert one.params - eight.params == experts - experts // 8


def test_tiny_moe_config():
    tc = demo.tiny_model_config("qwen3_vl_moe").text_config
    assert tc.num_experts >= 8 and tc.num_experts_per_tok == 2 and tc.router_aux_loss_coef > 0
    assert demo.tiny_processor("qwen3_vl_moe") is not None


@pytest.mark.parametrize("family, text, match", [
    ("qwen2_5_vl", ModuleParallel(data_parallel=2, expert_parallel=2),
     r"text.expert_parallel=2: the qwen2_5_vl family is a dense model"),
    ("qwen3_vl_moe", ModuleParallel(data_parallel=3, expert_parallel=3),
     r"text.expert_parallel=3 must divide the number of experts \(8\)"),
    ("qwen3_vl_moe", ModuleParallel(data_parallel=3, expert_parallel=2),
     r"text.expert_parallel=2 must be a positive integer dividing text.data_parallel \(3\)"),
    ("qwen3_vl_moe", ModuleParallel(data_parallel=2, expert_parallel=2, zero_stage=3),
     r"text.expert_parallel > 1 is not covered with text.zero_stage=3"),
    ("qwen2_5_vl", ModuleParallel(tensor_parallel=2, expert_tensor_parallel=True),
     r"text.expert_tensor_parallel=true: the qwen2_5_vl family is a dense model"),
    ("qwen3_vl_moe", ModuleParallel(data_parallel=2, expert_tensor_parallel=True),
     r"text.expert_tensor_parallel=true .* needs text.tensor_parallel > 1"),
    ("qwen3_vl_moe", ModuleParallel(tensor_parallel=2, data_parallel=2, expert_parallel=2,
                                    expert_tensor_parallel=True),
     r"text.expert_tensor_parallel=true and text.expert_parallel > 1 are exclusive"),
])
def test_driver_errors_name_the_key(family, text, match):
    with pytest.raises(ValueError, match=match):
        DHPConfig(model=demo.tiny_model_config(family), placement="disjoint", text=text)


def test_run_file_key(tmp_path):
    from ray_dhp.run_file import load_run_file

    path = tmp_path / "run.yaml"
    path.write_text("model: {demo: qwen3_vl_moe}\nplacement: disjoint\n"
                    "text: {data_parallel: 4, expert_parallel: 2}\n")
    topo = load_run_file(str(path), []).dhp_config().topology()
    assert topo.text_expert_parallel == 2 and "text_expert_parallel=2" in topo.describe()
    path.write_text("model: {demo: qwen3_vl_moe}\nplacement: disjoint\n"
                    "text: {tensor_parallel: 2, expert_tensor_parallel: true}\n")
    topo = load_run_file(str(path), []).dhp_config().topology()
    assert topo.text_expert_tp and "text_expert_tensor_parallel=true" in topo.describe()


def test_ep_groups_are_data_parallel_blocks():
    t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=4, text_tp=2, text_ep=2).text
    # replica j, TP index k is world rank 1 + 2 j + k: EP = consecutive replicas, same k
    assert ep_groups(t, 2) == [[1, 3], [5, 7], [2, 4], [6, 8]]
    assert edp_groups(t, 2) == [[1, 5], [3, 7], [2, 6], [4, 8]]


def test_aux_loss_equals_transformers_with_padding():
    from transformers.models.qwen3_vl_moe.modeling_qwen3_vl_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    rows, length, experts, layers = 3, 7, 8, 2
    mask = torch.ones(rows, length, dtype=torch.long)
    mask[1, 4:] = 0
    mask[2, 2:] = 0
    logits = [torch.randn(rows * length, experts, generator=g, dtype=torch.float64, requires_grad=True)
              for _ in range(layers)]
    ref = load_balancing_loss_func(tuple(logits), experts, 2, mask)
    got, loads = aux_contribution(logits, mask.bool(), experts, 2, None)
    assert torch.equal(got, ref) and loads.sum() == 2 * mask.sum() * layers
    ref_grads = torch.autograd.grad(ref, logits)
    got_grads = torch.autograd.grad(got, logits)
    assert all(torch.equal(a, b) for a, b in zip(got_grads, ref_grads))


def test_grouped_mm_path_equals_the_loop():
    """The CUDA path of the local experts (``torch._grouped_mm``, which CPU torch also runs in
    fp32) against the CPU loop, values and gradients, with an expert that gets no rows.
    fp32 tolerance: the two compute the same dot products with other blockings (~1e-7)."""
    from ray_dhp.parallel.expert import local_experts

    if not hasattr(torch, "_grouped_mm"):
        pytest.skip("this torch has no _grouped_mm")
    g = torch.Generator().manual_seed(0)
    experts, hidden, inter, rows = 4, 16, 8, 23
    x = torch.randn(rows, hidden, generator=g)
    which = torch.randint(0, experts, (rows,), generator=g)
    which[which == 2] = 1  # expert 2 gets nothing
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=g) * 0.1
    down = torch.randn(experts, hidden, inter, generator=g) * 0.1
    outs = []
    for grouped in (False, True):
        ins = [t.clone().requires_grad_(True) for t in (x, gate_up, down)]
        y = local_experts(torch.nn.functional.silu, ins[0], which, ins[1], ins[2], grouped)
        y.square().sum().backward()
        outs.append([y.detach()] + [t.grad for t in ins])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _plan_memory_lines(example: str) -> list:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run([sys.executable, "-m", "ray_dhp.cli", "plan",
                          os.path.join(root, "examples", example)],
                         cwd=root, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if " memory: state" in line]


def test_30b_a3b_example_fits_on_the_gpus_it_names():
    """`ray-dhp plan` of the example run file (30B-A3B, 8 H200s, text EP8): every rank fits
    below the device less its margin (docs/plan_accuracy.md)."""
    memory = _plan_memory_lines("qwen3_vl_30b_a3b_8gpu.yaml")
    assert len(memory) == 8 and all(line.endswith("[fits]") for line in memory), memory


@pytest.mark.slow
def test_235b_a22b_example_fits_on_the_128_gpus_it_names():
    """The 235B-A22B example (128 H200s: text TP2 x DP64, EP64, experts' optimizer state split
    over their 2 TP ranks) fits every rank (smaller counts: docs/placement.md)."""
    memory = _plan_memory_lines("qwen3_vl_235b_a22b_128gpu.yaml")
    assert len(memory) == 128 and all(line.endswith("[fits]") for line in memory), memory[:3]


def _preset(name):
    from transformers import AutoConfig

    from ray_dhp.cli.presets import preset_dims

    dims = preset_dims("qwen3_vl_moe", name)
    return AutoConfig.for_model(dims.pop("model_type"), **dims)


def test_recommend_picks_expert_parallelism_for_30b_a3b_on_8_gpus():
    """`--recommend` enumerates EP degrees (`ray_dhp.planning.experts.expert_degrees`): for
    30B-A3B on 8 x 80 GB (bf16_mixed, checkpointing) the fastest feasible layout is EP (without
    EP only text ZeRO-3 fits, and its weight all-gathers cost more than the token all-to-alls)."""
    from ray_dhp.planning.memory import ActivationSettings
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Workload, recommend
    from ray_dhp.step.precision import POLICIES

    config = _preset("30b-a3b")
    policy = POLICIES["bf16_mixed"]
    w = Workload(4096, 512, 32, micro_batches=4, policy=policy, state_bytes=policy.state_bytes(),
                 settings=ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=True))
    cands = recommend(config, 8, w, counts=count_params(config))
    assert {c.layout.text_ep for c in cands} >= {1, 2, 4, 8}  # EP degrees were considered
    feasible = [c for c in cands if c.feasible]
    dense = [c for c in feasible if c.layout.text_ep == 1]
    assert all(c.layout.topology().text.zero_stage == 3 for c in dense)
    best = feasible[0].layout
    assert best.text_ep > 1 and best.text_dp % best.text_ep == 0
    assert best.run_file_fragment()["text"]["expert_parallel"] == best.text_ep
    assert feasible[0].peak_memory_gib <= 80
    assert not dense or dense[0].step_s > feasible[0].step_s


def test_plan_traffic_has_the_expert_all_to_all_and_edp_gradients():
    """`ray-dhp plan --nodes`: EP adds the token all-to-all (`ray_dhp.planning.experts`), and the
    experts' gradients leave the text-DP reduction for the smaller EDP one."""
    from ray_dhp.planning.cost_types import Layout, Workload
    from ray_dhp.planning.experts import gradient_split, sent_bytes
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.traffic import collective_bytes, collective_groups

    config = _preset("30b-a3b")
    counts = count_params(config)
    w = Workload(4096, 512, 16, micro_batches=2)
    no_ep, ep4 = (collective_bytes(config, counts, Layout("collocated", "sequential", 1, 8, 1, 8,
                                                           text_ep=e), w) for e in (1, 4))
    assert no_ep["text expert all-to-all"] == 0 and ep4["text expert all-to-all"] > 0
    tokens = 1 * (512 + 4096 // 4)  # one sample per replica and micro-batch
    assert ep4["text expert all-to-all"] == sent_bytes(config, tokens, 4, 2, False, 4)
    dense, experts = gradient_split(counts, 1, 4)
    assert dense + 4 * experts == counts.text and ep4["text dp gradients"] < no_ep["text dp gradients"]
    assert ep4["text expert gradients"] > 0
    groups = collective_groups(Layout("collocated", "sequential", 1, 8, 1, 8, text_ep=4).topology(), 8)
    assert groups["text expert all-to-all"] == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("target, match", [
    ("experts", r"modules.llm.lora.target_modules: \['experts'\]: the fused experts are 3-D parameters"),
    ("gate", r"modules.llm.lora.target_modules: \['gate'\]: the router \(mlp.gate\) stays frozen"),
])
def test_lora_refuses_the_experts_and_the_router_naming_the_key(target, match):
    from ray_dhp.config.train_loop import TrainLoopConfig

    with pytest.raises(ValueError, match=match):
        TrainLoopConfig(modules={"llm": {"lora": {"target_modules": [target]}}})


def test_lora_targets_reach_the_shared_expert_not_the_router_or_experts():
    """The PEFT target regex on Qwen3.5-MoE's module names: attention and shared-expert linears."""
    import re

    from ray_dhp.models.lora import target_regex
    from ray_dhp.config.tuning import DEFAULT_LORA_TARGETS

    rx = re.compile(target_regex(DEFAULT_LORA_TARGETS))
    p = "model.language_model.layers.3"
    assert rx.fullmatch(f"{p}.self_attn.q_proj") and rx.fullmatch(f"{p}.mlp.shared_expert.down_proj")
    for name in ("mlp.gate", "mlp.experts", "mlp.shared_expert_gate", "linear_attn.in_proj_qkv"):
        assert not rx.fullmatch(f"{p}.{name}"), name
