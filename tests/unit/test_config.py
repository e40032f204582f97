"""Config errors are raised in the driver, before any worker starts, and say what to change."""

import pytest

from ray_dhp import DHPConfig, ModuleParallel, TrainLoopConfig, demo


def _cfg(**kw):
    base = dict(model=demo.tiny_model_config(), processor=None)
    base.update(kw)
    return DHPConfig(**base)


def test_valid_layouts_give_worker_counts():
    assert _cfg(vision=ModuleParallel(sequence_parallel=2),
                text=ModuleParallel(tensor_parallel=2)).num_workers == 2
    assert _cfg(vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2,
                data_parallel=3), placement="disjoint").num_workers == 8


@pytest.mark.parametrize("kw, match", [
    (dict(placement="diagonal"), r"placement='diagonal'.*collocated"),
    (dict(vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=4)),
     "products match"),
    (dict(vision=ModuleParallel(sequence_parallel=3, data_parallel=1),
          text=ModuleParallel(tensor_parallel=1, data_parallel=3)),
     r"sequence_parallel=3 must divide the vision attention heads \(4\); use one of \[1, 2, 4\]"),
    (dict(vision=ModuleParallel(data_parallel=8), text=ModuleParallel(tensor_parallel=8)),
     r"tensor_parallel=8 must divide the language model's attention heads \(4\)"),
    (dict(vision=ModuleParallel(tensor_parallel=2), text=ModuleParallel(tensor_parallel=2)),
     "vision group uses sequence_parallel"),
    (dict(schedule="zigzag"), "schedule"),
    (dict(model="/nonexistent/dir"), "not a local directory"),
])
def test_bad_dhp_config_fails_early(kw, match):
    with pytest.raises(ValueError, match=match):
        _cfg(**kw)


def test_kv_heads_must_divide_tp():
    config = demo.tiny_model_config()
    config.text_config.num_key_value_heads = 2
    with pytest.raises(ValueError, match=r"KV heads \(2\)"):
        DHPConfig(model=config, vision=ModuleParallel(data_parallel=4),
                  text=ModuleParallel(tensor_parallel=4))


def test_module_parallel_rejects_nonsense():
    with pytest.raises(ValueError, match="integer >= 1"):
        ModuleParallel(sequence_parallel=0)
    with pytest.raises(ValueError, match="not both"):
        ModuleParallel(sequence_parallel=2, tensor_parallel=2)


def test_num_workers_mismatch_names_the_fix():
    cfg = _cfg(vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    with pytest.raises(ValueError, match="set num_workers=2"):
        cfg.validate_workers(3)


def test_train_loop_config_typo_suggests_the_key():
    with pytest.raises(ValueError, match="did you mean 'global_batch_size'"):
        TrainLoopConfig.from_dict({"global_batchsize": 4})
    with pytest.raises(ValueError, match=r"divisible by train_loop_config\.micro_batches=4"):
        TrainLoopConfig.from_dict({"global_batch_size": 6, "micro_batches": 4})
