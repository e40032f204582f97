"""Text sequence parallelism: the run-file key, the driver's errors, the padding and the
deepstack row selection (the exactness itself: tests/distributed/test_text_sp.py)."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.layout import DHPConfig, ModuleParallel
from ray_dhp.parallel.text_sp import local_visual_rows
from ray_dhp.parallel.topology import Topology


def test_topology_needs_tp_for_text_sp():
    t = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2,
                       text_sequence_parallel=True)
    assert t.text_sequence_parallel and "text_sequence_parallel=true" in t.describe()
    with pytest.raises(ValueError, match="needs text tensor_parallel > 1"):
        Topology.build(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1,
                       text_sequence_parallel=True)


@pytest.mark.parametrize("kw, match", [
    (dict(text=ModuleParallel(sequence_parallel=True)), "needs text tensor_parallel > 1"),
    (dict(vision=ModuleParallel(sequence_parallel=True)), "vision.sequence_parallel is the Ulysses degree"),
    (dict(text=ModuleParallel(sequence_parallel=2, tensor_parallel=1)), "true/false"),
])
def test_driver_errors_name_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        DHPConfig(model=demo.tiny_model_config(), **kw)


def test_config_and_run_file_turn_it_on(tmp_path):
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.run_file import load_run_file

    cfg = DHPConfig(model=demo.tiny_model_config(), vision=ModuleParallel(sequence_parallel=2),
                    text=ModuleParallel(tensor_parallel=2, sequence_parallel=True))
    assert cfg.topology().text_sequence_parallel and cfg.num_workers == 2
    path = tmp_path / "run.yaml"
    path.write_text("model: {demo: qwen2_5_vl}\nvision: {sequence_parallel: 2}\n"
                    "text: {tensor_parallel: 2, sequence_parallel: true}\n")
    assert load_run_file(str(path), []).dhp_config().topology().text_sequence_parallel
    with pytest.raises(ConfigError, match="null is not allowed"):
        load_run_file(str(path), ["text.sequence_parallel=null"])


def test_uncovered_family_fails_in_the_driver():
    import dataclasses

    from ray_dhp.models import family_of

    config = demo.tiny_model_config()
    fam = dataclasses.replace(family_of(config), text_sp_plan=None)
    with pytest.raises(ValueError, match="not covered"):
        fam.validate_layout(config, sp=1, tp=2, text_sp=True)


def test_local_visual_rows_pick_the_shards_feature_rows():
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 0, 0, 1, 1, 0]], dtype=torch.bool)  # 6 image rows
    local, rows = local_visual_rows(mask, 2, 4)  # positions 2, 3 of both samples
    assert local.tolist() == [[True, False], [False, True]]
    assert rows.tolist() == [1, 4]  # row-major order of the full mask's True entries


def test_packing_pads_to_a_multiple():
    from ray_dhp.data.collate import pack_text_batch

    from ray_dhp.data.sample import Sample

    samples = [Sample(index=i, input_ids=torch.arange(n), labels=torch.arange(n),
                      mm_token_type_ids=torch.zeros(n, dtype=torch.long)) for i, n in enumerate((5, 6))]
    b = pack_text_batch(samples, 0, None, pad_to_multiple_of=4)
    assert b["input_ids"].shape == (1, 12) and b["position_ids"].shape == (4, 1, 12)
    assert (b["targets"][0, 11:] == -100).all() and b["position_ids"][0, 0, 11].item() == 0
