"""ZeRO stages in the configuration: defaults, and bad input refused before any worker starts,
naming the key (`ray_dhp.parallel.zero.resolve_stage`, `ModuleParallel.zero_stage`)."""

import pytest

from ray_dhp import DHPConfig, ModuleParallel, demo
from ray_dhp.parallel.zero import replica_bytes
from ray_dhp.models.sizes import TextParam
from ray_dhp.parallel.topology import Topology


def _layout(**kw):
    base = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
    return Topology.build(**{**base, **kw})


def test_default_is_stage_1_where_a_module_has_replicas():
    t = _layout()
    assert (t.vision.zero_stage, t.text.zero_stage) == (1, 1)
    t = _layout(vision_dp=1, vision_sp=4, text_dp=1, text_tp=4)
    assert (t.vision.zero_stage, t.text.zero_stage) == (1, 0)  # the ViT is replicated over SP
    cfg = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2, zero_stage=2),
                    text=ModuleParallel(data_parallel=2, zero_stage=3))
    assert (cfg.topology().vision.zero_stage, cfg.topology().text.zero_stage) == (2, 3)
    t = _layout(vision_dp=1, vision_sp=4, vision_zero=3)  # FSDP2 over the SP ranks alone
    assert t.vision.zero_stage == 3


@pytest.mark.parametrize("kw, match", [
    (dict(text_zero=4), r"text.zero_stage must be one of"),
    (dict(text_zero=True), r"text.zero_stage must be one of"),
    (dict(text_dp=1, text_tp=4, text_zero=1), r"text.zero_stage=1 .* only one; set text.data_parallel"),
    (dict(vision_dp=1, vision_sp=1, placement="disjoint", vision_zero=2),
     r"vision.zero_stage=2 .* only one"),
    (dict(vision_zero=3, vision_offload=True),
     r"vision.optimizer_offload=true needs plain parameters, but vision has zero_stage=3 .* set "
     r"vision.zero_stage <= 2, or vision.optimizer_offload=false"),
])
def test_bad_stages_fail_naming_the_key(kw, match):
    with pytest.raises(ValueError, match=match):
        _layout(**kw)


def test_module_parallel_checks_the_stage():
    with pytest.raises(ValueError, match="zero_stage"):
        ModuleParallel(zero_stage=7)


def test_run_file_key_is_named(tmp_path):
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.run_file import load_run_file

    path = tmp_path / "run.yaml"
    path.write_text("model: {demo: qwen2_5_vl}\ntext: {data_parallel: 1, zero_stage: 9}\n")
    with pytest.raises(ConfigError, match=r"text.zero_stage"):
        load_run_file(str(path)).dhp_config()


def test_fsdp_share_follows_torch_chunk():
    q = TextParam(numel=10 * 4, sharded=False, dim0=10, dim0_sharded=False, trained=True)
    assert [q.fsdp_share(i, 4, 1) for i in range(4)] == [12, 12, 12, 4]  # rows 3, 3, 3, 1
    col = TextParam(numel=8 * 6, sharded=True, dim0=8, dim0_sharded=True, trained=True)
    assert [col.fsdp_share(i, 2, 2) for i in range(2)] == [12, 12]  # 4 local rows -> 2 + 2


def test_replica_traffic_per_stage():
    g, w = 4.0, 2.0
    assert replica_bytes(1, 3, g, w) == 0.0
    assert [replica_bytes(2, s, g, w) for s in range(4)] == [4.0, 5.0, 3.0, 4.0]
