"""Tracking helpers without Ray workers: metric flattening, config flattening, the TensorBoard
callback writing events that read back, and the Ray report-log switch."""

import logging
from types import SimpleNamespace

import pytest

from ray_dhp.train.tracking import TensorBoardLogger, flatten_config, flatten_metrics, set_ray_report_logs


def test_flatten_metrics_keeps_numbers_only():
    m = {"step": 3, "loss": 1.5, "ok": True, "name": "x", "none": None,
         "peak": [10.0, 12.5], "draws": {"a": 2, "b": {"c": 1}}}
    assert flatten_metrics(m) == {"step": 3.0, "loss": 1.5, "ok": 1.0, "peak/0": 10.0,
                                  "peak/1": 12.5, "draws/a": 2.0, "draws/b/c": 1.0}


def test_flatten_config_dotted_strings():
    assert flatten_config({"lr": 1e-3, "dhp": {"vision": {"sequence_parallel": 2}}}) == {
        "lr": "0.001", "dhp.vision.sequence_parallel": "2"}


def test_tensorboard_logger_writes_each_report_at_its_step(tmp_path):
    from tests.ray.tensorboard_events import read_scalars

    ctx = SimpleNamespace(run_config=SimpleNamespace(storage_path=str(tmp_path), name="r"))
    cb = TensorBoardLogger({"lr": 1e-3})
    for step, loss in ((1, 3.0), (5, 2.0), (9, float("nan"))):
        cb.after_report(ctx, [{"step": step, "loss": loss, "lr": 1e-3}, {"step": step}], None)
    cb.after_report(ctx, [{}], None)  # an empty report (e.g. a checkpoint only) writes nothing
    got = read_scalars(str(tmp_path / "r" / "tensorboard"))
    assert got["loss"] == {1: 3.0, 5: 2.0}  # non-finite values are left out
    assert sorted(got["lr"]) == [1, 5, 9] and "step" not in got


@pytest.mark.parametrize("enabled", [False, True])
def test_ray_report_logs_switch(enabled):
    import ray.train.v2._internal.execution.context as ctx_mod

    set_ray_report_logs(enabled)
    try:
        # off: the logger drops INFO; on: its level is unset again (Ray's logging config rules)
        assert ctx_mod.logger.level == (logging.NOTSET if enabled else logging.WARNING)
    finally:
        set_ray_report_logs(True)
