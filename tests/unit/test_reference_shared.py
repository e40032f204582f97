"""The pieces the single-process reference shares with the engine, against the stock libraries.

Parity tests compare the engine with `ray_dhp.step.reference`; whatever both call cannot be
wrong in a way parity sees (tests/README.md). The reference builds LoRA, freezing, the AdamW
groups and the fp32 masters itself; what it still shares is checked here:

* the loss normalisation (`ray_dhp.step.loss` with its default loss, the batch padding): one
  step's loss is transformers' own ``model(..., labels=...).loss`` (mean cross-entropy over
  the target tokens, labels shifted by the model);
* the lr schedule's factor (`ray_dhp.step.optim.lr_factor`): transformers' own
  ``get_{constant,linear,cosine}_schedule_with_warmup``, one step earlier during warmup (ours
  starts at lr / warmup_steps, transformers' at 0).
"""

from dataclasses import replace

import pytest
import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig

FAMILY = "qwen2_5_vl"


def test_reference_loss_is_transformers_loss(tmp_path):
    """One micro-batch of 4 samples (images and text-only, padded), fp64 model. Tolerance 1e-6
    relative: transformers' loss upcasts the logits to fp32 (``logits.float()`` in its
    ``ForCausalLMLoss``), so its value is fp32-accurate (measured 1.4e-8); a normalisation bug
    (per sample, per micro-batch, padding counted) is off by percents."""
    from ray_dhp.data.collate import pad_text_batch
    from ray_dhp.step.reference import ReferenceTrainer
    from tests.distributed.parity import make_steps

    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1)
    (micro_batches,) = make_steps(tmp_path, FAMILY, cfg)
    assert len(micro_batches) == 1 and len(micro_batches[0]) == 4
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision, dtype=torch.float64)
    batch = pad_text_batch(micro_batches[0], ref.config.text_config.pad_token_id or 0)
    assert (batch["attention_mask"] == 0).any()  # really padded
    kwargs = {k: v for k, v in batch.items() if v is not None}
    kwargs["pixel_values"] = kwargs["pixel_values"].to(torch.float64)
    with torch.no_grad():
        want = float(ref.model(**kwargs, use_cache=False).loss)
    got = ref.step(micro_batches)["loss"]
    assert abs(got - want) <= 1e-6 * want, (got, want)


@pytest.mark.parametrize("schedule", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup", [0, 1, 3])
def test_lr_factor_is_transformers_schedule(schedule, warmup):
    from transformers import optimization

    from ray_dhp.step.optim import lr_factor

    cfg = replace(TrainLoopConfig(lr=1.0, global_batch_size=1, num_steps=10), lr_schedule=schedule,
                  warmup_steps=warmup)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    make = getattr(optimization, f"get_{schedule}_schedule_with_warmup")
    kwargs = {} if schedule == "constant" else {"num_training_steps": cfg.optim.num_steps}
    hf = make(opt, num_warmup_steps=warmup, **kwargs).lr_lambdas[0]
    for step in range(cfg.optim.num_steps):
        want = hf(step + 1) if step < warmup else hf(step)
        assert lr_factor(step, cfg.optim) == pytest.approx(want, rel=1e-12, abs=1e-15), (step, want)
