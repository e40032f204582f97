"""Train the bundled tiny VLM with your own train loop and a custom loss (docs/custom_loop.md).

    python examples/custom_loss.py [--steps 8] [--storage ~/ray_results] [--resume-from CKPT]

Vision Ulysses SP=2 and text TP=2 collocated on 2 Ray workers, as in the demo, but the
``train_loop_per_worker`` is ours: it builds the engine and the loader from ray_dhp's building
blocks, trains with ``forward_backward(loss_fn=...)`` + ``optimizer_step()``, reports every step
and saves a sharded checkpoint every ``checkpoint_every`` steps and at the end (resumable, at
any layout). The loss: answers about an image weigh ``IMAGE_WEIGHT`` times a text-only answer,
with label smoothing and a z-loss — all from per-token statistics that are exact under TP.
"""

from __future__ import annotations

import argparse
import os

import torch

import ray_dhp
from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, TrainLoopConfig, demo

IMAGE_WEIGHT, SMOOTHING, Z_LOSS = 2.0, 0.1, 1e-4


def weighted_smoothed_loss(inputs: ray_dhp.LossInputs) -> torch.Tensor:
    """This replica's share of the step's loss (summed over replicas and micro-batches by the
    engine), normalised by the step's global target count."""
    lse = inputs.logsumexp()                                  # [R, L], exact under TP
    smooth = lse - inputs.mean_logit()                         # cross-entropy vs uniform
    per_token = (1 - SMOOTHING) * inputs.token_loss() + SMOOTHING * smooth + Z_LOSS * lse ** 2
    weights = torch.tensor([IMAGE_WEIGHT if s.image_grid_thw is not None else 1.0
                            for s in inputs.samples] + [0.0],  # index -1 (padding): weight 0
                           dtype=per_token.dtype, device=per_token.device)
    per_token = per_token * weights[inputs.sample_ids]
    return per_token[inputs.mask].sum() / inputs.num_targets


def train_fn(config: dict) -> dict:
    """The ``train_loop_per_worker``: runs on every worker, collectively."""
    cfg = TrainLoopConfig.from_dict(config)
    engine = ray_dhp.build_engine(cfg)                 # this rank's shards and optimizers
    processor = ray_dhp.build_processor()
    loader = ray_dhp.build_loader(cfg, engine, processor=processor)
    first = ray_dhp.load_checkpoint(engine, loader, cfg.checkpoint.resume_from)  # 0: fresh run
    loader.start(cfg.optim.num_steps - first)          # prepares step k+1 while step k trains
    try:
        for step in range(first, cfg.optim.num_steps):
            out = engine.forward_backward(loader.next(), loss_fn=weighted_smoothed_loss, last=True)
            out.update(engine.optimizer_step())        # clip + AdamW + schedule
            metrics = {"step": step + 1, "loss": out["loss"], "grad_norm": out["grad_norm"],
                       "lr": out["lr"]}
            every = cfg.checkpoint.checkpoint_every
            if step + 1 == cfg.optim.num_steps or (every and (step + 1) % every == 0):
                ray_dhp.report_checkpoint(metrics, engine, loader, processor)
            else:
                ray_dhp.report(metrics)
    finally:
        loader.close()
    return {"resumed_from_step": first, "final_step": engine.step_count}


def train_config(steps: int) -> dict:
    return dict(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=steps, seed=0,
                max_grad_norm=1.0, checkpoint_every=4, lr_schedule="constant")


def main(argv=None):
    import ray
    import ray.train

    from ray_dhp.train.callbacks import MetricsHistory

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--storage", default="~/ray_results")
    p.add_argument("--name", default="custom_loss")
    p.add_argument("--data", default="/tmp/ray_dhp_custom_data")
    p.add_argument("--resume-from", default=None, help="a checkpoint (e.g. of an earlier run)")
    args = p.parse_args(argv)
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=8)
    path = demo.make_dataset(args.data, num_samples=32, seed=0)
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    trainer = DisaggregatedTrainer(
        train_fn,
        train_loop_config=train_config(args.steps),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=dhp.num_workers,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name=args.name, storage_path=os.path.expanduser(args.storage),
                                       callbacks=[MetricsHistory(args.steps)]),  # progress lines
        datasets={"train": str(path)},
        resume_from=args.resume_from,
    )
    result = trainer.fit()
    print(f"custom loss: {result.return_value}; last checkpoint {result.checkpoint.path}")
    return result


if __name__ == "__main__":
    main()
