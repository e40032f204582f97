"""examples/custom_loss.py (a user's own train loop with a custom loss, under
DisaggregatedTrainer at vision SP=2 / text TP=2) trains like the single-process reference with
the same loss, checkpoints, and resumes from its checkpoint.

Tolerance: the run is fp32 (the example's precision), so per step the loss is compared with the
reference within 1e-5 relative (test_parity's fp32 bound for losses: summation-order noise of
sharded matmuls and all-reduces is ~1e-7 relative per step and a handful of AdamW steps at
lr=1e-3 keeps it far below 1e-5; a wrong loss, a replica counted twice or a lost update is off
by >= 1e-3).
"""

import importlib.util
import json
import os
import sys

import ray.cloudpickle

from ray_dhp import demo
from ray_dhp.train.callbacks import read_history
from ray_dhp.data.sources import make_sampler
from ray_dhp.step.reference import ReferenceTrainer
from ray_dhp.config.train_loop import TrainLoopConfig

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "custom_loss.py")


def _example():
    spec = importlib.util.spec_from_file_location("custom_loss_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    ray.cloudpickle.register_pickle_by_value(module)  # the workers cannot import it by name
    return module


def _reference_losses(ex, data_dir, steps):
    path = os.path.join(data_dir, "data.jsonl")
    cfg = TrainLoopConfig.from_dict({**ex.train_config(steps), "dataset_paths": {"train": path}})
    sampler = make_sampler(cfg.sampler_config(), demo.tiny_processor())
    ref = ReferenceTrainer(demo.tiny_model_config(), cfg.optim, precision=cfg.precision)
    return [ref.step(sampler.next_step(), loss_fn=ex.weighted_smoothed_loss)["loss"]
            for _ in range(steps)]


def _close(got, want, tol=1e-5):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert abs(g - w) <= tol * abs(w), (got, want)


def test_custom_loss_example_trains_checkpoints_and_resumes(ray_start, fast_reports, tmp_path):
    ex = _example()
    common = ["--storage", str(tmp_path / "runs"), "--data", str(tmp_path / "data")]
    result = ex.main(common + ["--steps", "4", "--name", "first"])
    history = read_history(result)
    assert [m["step"] for m in history] == [1, 2, 3, 4]
    ref = _reference_losses(ex, tmp_path / "data", 6)
    _close([m["loss"] for m in history], ref[:4])
    assert history[-1]["loss"] < 0.97 * history[0]["loss"]  # it learns (measured: -7.5 % in 4 steps)
    # a complete sharded checkpoint of step 4 (checkpoint_every=4 and the last step)
    ckpt = result.checkpoint.path
    with open(os.path.join(ckpt, "ray_dhp_checkpoint.json")) as f:
        assert json.load(f)["step"] == 4
    assert os.path.isfile(os.path.join(ckpt, "COMMIT"))
    # resume in a new run: steps 5-6 continue exactly where the reference continues
    cont = ex.main(common + ["--steps", "6", "--name", "resumed", "--resume-from", ckpt])
    assert cont.return_value == {"resumed_from_step": 4, "final_step": 6}
    _close([m["loss"] for m in read_history(cont)], ref[4:])
