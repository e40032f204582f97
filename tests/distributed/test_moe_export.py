"""Export of a trained mixture-of-experts model: one fp64 step with the experts sharded (EP2:
``Shard(0)`` over the replicas; or by TP: ``Shard(1)`` / ``Shard(2)`` of the intermediate dim),
a DCP checkpoint, `ray_dhp.export_hf`, then the stock ``from_pretrained``: every parameter equals
the engine's full trained parameter bit for bit (no tolerance: export only moves bytes; the
experts go through transformers' own fused <-> per-expert conversion on save and load)."""

import os

import pytest
import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import merge_ranks, moe_layout
from tests.spawn import run_on_ranks

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=1, max_grad_norm=1.0)


def _body(rank, world, family, layout, data, ckpt):
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(family), groups, CFG.step_config(), dtype=torch.float64)
    sampler = StepSampler(read_annotations(data), demo.tiny_processor(family), resolve_data_root(data), CFG.sampler_config())
    params0 = engine.named_full_parameters()
    engine.step(sampler.next_step())
    checkpoint.save(ckpt, engine, sampler)
    return {"history": [], "params0": params0, "params": engine.named_full_parameters()}


CASES = [
    pytest.param("qwen3_vl_moe", moe_layout("collocated", (1, 2), (1, 2), 2), id="qwen3_vl_moe-ep2"),
    pytest.param("qwen3_5_moe", moe_layout("collocated", (1, 2), (1, 2), 2), id="qwen3_5_moe-ep2",
                 marks=pytest.mark.slow),
    pytest.param("qwen3_vl_moe", dict(moe_layout("collocated", (2, 1), (2, 1)), text_expert_tp=True),
                 id="qwen3_vl_moe-tp2-experts-tp", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("family, layout", CASES)
def test_moe_export_round_trips_through_from_pretrained(family, layout, tmp_path):
    import transformers

    from ray_dhp import export_hf
    from ray_dhp.models import FAMILIES

    data = str(demo.make_dataset(tmp_path / "data", num_samples=8, seed=0, text_only_every=4))
    ckpt = str(tmp_path / "ckpt" / "checkpoint_000001")
    got = merge_ranks(run_on_ranks(_body, 2, args=(family, layout, data, ckpt)))
    out = export_hf(ckpt, str(tmp_path / "hf"))
    cls = getattr(transformers, FAMILIES[family].model_class)
    exported = dict(cls.from_pretrained(out, dtype=torch.float64).named_parameters())
    assert set(exported) == set(got["params"])
    experts = [n for n in exported if n.endswith("mlp.experts.gate_up_proj")]
    assert experts
    for name, p in got["params"].items():
        assert torch.equal(exported[name], p), name
    # the step moved the experts (the export is of trained weights, not of the init)
    assert any(not torch.equal(got["params"][n], got["params0"][n]) for n in experts)
    saved = [f for f in os.listdir(out) if f.endswith(".safetensors")]
    assert saved
