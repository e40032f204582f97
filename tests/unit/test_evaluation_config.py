"""Evaluation settings (issue #14): contradictory choices fail in the driver, before Ray starts,
naming the Python-API or run-file key; the validation loader covers every valid record once."""

from pathlib import Path

import pytest
import ray

from ray_dhp import demo
from ray_dhp.cli import main
from ray_dhp.cli.schema import ConfigError
from ray_dhp.run_file import load_run_file

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "examples" / "tiny.yaml")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("evalcfg")
    return (str(demo.make_dataset(tmp / "train", num_samples=4)),
            str(demo.make_dataset(tmp / "val", num_samples=3, seed=1)))


def _trainer(loop: dict, datasets: dict, score=None):
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel

    cfg = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    run = ray.train.RunConfig(checkpoint_config=ray.train.CheckpointConfig(
        checkpoint_score_attribute=score, checkpoint_score_order="min"))
    return DisaggregatedTrainer(train_loop_config=loop, dhp_config=cfg, run_config=run,
                                datasets=datasets)


CKPT_SCORE = r"run_config\.checkpoint_config\.checkpoint_score_attribute='eval_loss'"


@pytest.mark.parametrize("loop, with_val, score, message", [
    ({"eval_every": 5}, False, None,
     r'train_loop_config\.eval_every=5 evaluates on a validation set, but there is none: set '
     r'datasets\["validation"\]'),
    ({}, False, "eval_loss", CKPT_SCORE + " ranks checkpoints by an evaluation metric, but there "
                                          r"is no validation set"),
    ({"checkpoint_every": 4, "eval_every": 3}, True, "eval_loss",
     r"train_loop_config\.checkpoint_every=4 must be a multiple of train_loop_config\.eval_every=3"),
    ({"checkpoint_every": 4}, True, "eval_loss",
     r"checkpoint_every=4 must be a multiple of train_loop_config\.eval_every=0 \(evaluations run "
     r"only at the end\)"),
    ({}, True, "eval_los", r"='eval_los' is not reported; did you mean 'eval_loss'\? \(an "
                           r"evaluation reports \['eval_loss'"),
    ({}, True, "val_loss", r"='val_loss' is not reported; did you mean 'eval_loss'\?"),
    ({}, True, "eval_accuracy", r"='eval_accuracy' is not reported \(an evaluation reports"),
    ({"dataset_weights": {"train": 1, "validation": 1}}, True, None,
     r"train_loop_config\.dataset_weights: names 'validation', the evaluation set"),
])
def test_python_api_rejects_contradictory_evaluation_settings(loop, with_val, score, message, files,
                                                             forbid_ray_init):
    train, val = files
    datasets = {"train": train, **({"validation": val} if with_val else {})}
    with pytest.raises(ValueError, match=message):
        _trainer(loop, datasets, score)
    assert not forbid_ray_init


def test_python_api_accepts_matching_cadences(files, forbid_ray_init):
    train, val = files
    t = _trainer({"checkpoint_every": 4, "eval_every": 2}, {"train": train, "validation": val},
                 "eval_loss")
    assert t.train_loop_config["dataset_paths"]["validation"] == val
    _trainer({"checkpoint_every": 4, "eval_every": 4}, {"train": train, "validation": val}, "eval_loss")
    _trainer({"checkpoint_every": 0}, {"train": train, "validation": val}, "eval_loss")  # end only
    assert not forbid_ray_init


@pytest.mark.parametrize("overrides, message", [
    (["data.eval_every=2"], "data.eval_every=2 evaluates on a validation set, but there is none: "
                            "set data.validation"),
    (["checkpoint.score_attribute=eval_loss", "checkpoint.checkpoint_every=4", "data.eval_every=3",
      "data.validation={val}"],
     "checkpoint.score_attribute='eval_loss' ranks checkpoints by an evaluation metric, so each "
     "checkpoint step needs an evaluation: checkpoint.checkpoint_every=4 must be a multiple of "
     "data.eval_every=3"),
    (["checkpoint.score_attribute=eval_loss"], "checkpoint.score_attribute='eval_loss' ranks "
                                               "checkpoints by an evaluation metric, but there is "
                                               "no validation set: set data.validation"),
    (["checkpoint.score_order=lowest"], "checkpoint.score_order: must be one of"),
    (["data.validation={val}", "data.datasets={{validation: {val}}}"],
     'data.datasets.validation: the dataset "validation" is data.validation'),
])
@pytest.mark.parametrize("command", ["config", "train"])
def test_run_file_rejects_contradictory_evaluation_settings(overrides, message, command, files,
                                                            capsys, forbid_ray_init, tmp_path):
    _, val = files
    argv = [command, TINY, *[o.format(val=val) for o in overrides], f"run.storage_path={tmp_path}"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"ray-dhp {command}: configuration error: {message}" in err, err
    assert not forbid_ray_init and not list(tmp_path.iterdir())


def test_run_file_validation_reaches_the_trainer(files, tmp_path):
    from ray_dhp.cli.train import build_trainer, prepare_data

    _, val = files
    rf = load_run_file(TINY, [f"data.validation={val}", "data.eval_every=5",
                              "checkpoint.score_attribute=eval_loss", "checkpoint.num_to_keep=1",
                              "checkpoint.checkpoint_every=10", f"run.storage_path={tmp_path}"])
    datasets = prepare_data(rf)
    assert datasets["validation"] == val
    trainer = build_trainer(rf, datasets=datasets)
    assert trainer.train_loop_config["data"]["eval_every"] == 5
    ck = trainer.run_config.checkpoint_config
    assert (ck.checkpoint_score_attribute, ck.checkpoint_score_order, ck.num_to_keep) == ("eval_loss", "min", 1)


def test_sweep_on_eval_loss_needs_a_validation_set(forbid_ray_init):
    from ray_dhp.tune import sweep

    with pytest.raises(ConfigError, match="sweep metric='eval_loss' is an evaluation metric: set "
                                          "data.validation"):
        sweep(TINY, {"optim.lr": 1e-3}, metric="eval_loss")
    assert not forbid_ray_init


def test_eval_loader_covers_each_valid_record_once_in_order(tmp_path):
    """One process: batches of 2 records over 5, record 1 bad; every valid record exactly once, in
    file order, the last batch partial; the bad one is remembered (not decoded again)."""
    from ray_dhp.data.eval_loader import EvalLoader
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.config.train_loop import TrainLoopConfig

    path = demo.make_dataset(tmp_path, num_samples=5, bad_lines=[(1, "corrupt_image")])
    sampler = StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path),
                          TrainLoopConfig().sampler_config())
    loader = EvalLoader(sampler, None, batch_size=2)
    for _ in range(2):
        got = [[[s.index for s in mb] for mb in step] for step in loader.batches()]
        assert got == [[[0]], [[2, 3]], [[4]]]
    assert loader.skipped == 1 and loader.processed_here == 5 + 4  # record 1 decoded once only
    with pytest.raises(ValueError, match="bad sample at .*data.jsonl:2"):
        strict = StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path),
                             TrainLoopConfig(bad_data="strict").sampler_config())
        list(EvalLoader(strict, None, batch_size=2).batches())


def test_tune_callback_forwards_only_reports_with_the_metric(monkeypatch):
    """Tune requires its metric in every result: with metric="eval_loss" only evaluation reports
    reach the trial's queue (rank 0's metrics, plus the checkpoint path as Ray's callback adds)."""
    import ray.tune.integration.ray_train as rt

    from ray_dhp.tune import metric_report_callback

    queue = []

    class _Session:
        def _get_or_create_inter_actor_queue(self):
            return type("Q", (), {"put": staticmethod(queue.append)})()

    monkeypatch.setattr(rt, "_in_tune_session", lambda: True)
    monkeypatch.setattr(rt, "get_session", lambda: _Session())
    cb = metric_report_callback("eval_loss")
    cb.after_report(None, [{"step": 1, "loss": 2.0}, {"step": 1, "loss": 2.0}], None)
    cb.after_report(None, [{"step": 2, "loss": 1.5, "eval_loss": 1.7}, {}], None)
    assert queue == [{"step": 2, "loss": 1.5, "eval_loss": 1.7}]
    metric_report_callback().after_report(None, [{"step": 3, "loss": 1.0}], None)  # None: all
    assert queue[-1] == {"step": 3, "loss": 1.0}
