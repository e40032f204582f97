"""The main job: train the bundled tiny VLM end to end with DHP on CPU (``python -m ray_dhp.demo``).

The job imports the demo's data and model helpers (`ray_dhp.demo`); they do not import it.
"""

from __future__ import annotations

import argparse
import os
import tempfile


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="python -m ray_dhp.demo", description=__doc__.splitlines()[0])
    p.add_argument("--family", default="qwen2_5_vl", choices=["qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe"])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--placement", default="collocated", choices=["collocated", "disjoint"])
    p.add_argument("--sp", type=int, default=2, help="vision sequence-parallel degree")
    p.add_argument("--vision-dp", type=int, default=1)
    p.add_argument("--tp", type=int, default=2, help="text tensor-parallel degree")
    p.add_argument("--text-dp", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--samples", type=int, default=64)
    p.add_argument("--log-every", type=int, default=5)
    p.add_argument("--video", action="store_true",
                   help="train on generated moving-square videos (\"Which way does the square "
                        "move?\"), mixed with image and text-only samples")
    p.add_argument("--audio", action="store_true",
                   help="a Qwen2.5-Omni thinker with three modules (audio, vision, text) on a generated "
                        "set of clips, images, videos and text-only samples")
    p.add_argument("--audio-dp", type=int, default=None,
                   help="audio data-parallel degree (default: the vision group's size when "
                        "collocated, 1 when disjoint)")
    p.add_argument("--out", default=None, help="folder for data and run storage (default: a temp dir)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import ray
    import ray.train

    from ray_dhp import DHPConfig, DisaggregatedTrainer, ModuleParallel, demo
    from ray_dhp.train.callbacks import read_history

    out = os.path.abspath(args.out or tempfile.mkdtemp(prefix="ray_dhp_demo_"))
    video_keys, audio = {}, None
    if args.audio:
        from ray_dhp.demo.omni import make_omni_dataset

        args.family = "qwen2_5_omni"
        n = max(4, args.samples // 4)
        data = make_omni_dataset(os.path.join(out, "data"), images=2 * n, clips=n, videos=n // 2)
        dp = args.audio_dp or (args.sp * args.vision_dp if args.placement == "collocated" else 1)
        audio = ModuleParallel(data_parallel=dp)
    elif args.video:
        from ray_dhp.demo.video import make_video_dataset

        data = make_video_dataset(os.path.join(out, "data"), num_samples=args.samples, seed=0)
        unit = 32 if args.family == "qwen3_vl" else 28  # frames of 2x2 merge units (4x4 patches)
        video_keys = dict(video_min_pixels=(2 * unit) ** 2, video_max_pixels=(2 * unit) ** 2)
    else:
        data = demo.make_dataset(os.path.join(out, "data"), num_samples=args.samples, seed=0)
    cfg = DHPConfig(
        model=demo.tiny_model_config(args.family),
        processor=demo.tiny_processor(args.family),
        vision=ModuleParallel(sequence_parallel=args.sp, data_parallel=args.vision_dp),
        text=ModuleParallel(tensor_parallel=args.tp, data_parallel=args.text_dp),
        audio=audio,
        placement=args.placement,
    )
    print(f"[ray_dhp] layout:\n{cfg.topology().describe()}", flush=True)
    if not ray.is_initialized():
        # A private local Ray (never another job's cluster on the machine), with more logical
        # CPUs than cores so small machines can host the workers.
        ray.init(address="local", num_cpus=max(8, 2 * cfg.num_workers))
    trainer = DisaggregatedTrainer(
        train_loop_config=dict(lr=args.lr, global_batch_size=args.batch_size, num_steps=args.steps,
                               seed=0, log_every=args.log_every, warmup_steps=3,
                               lr_schedule="cosine", max_grad_norm=1.0, **video_keys),
        dhp_config=cfg,
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers,
                                               resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="ray_dhp_demo", storage_path=os.path.join(out, "runs")),
        datasets={"train": str(data)},
    )
    result = trainer.fit()
    hist = read_history(result)
    first, last = hist[0], hist[-1]
    print(f"[ray_dhp] done: loss {first['loss']:.4f} (step {first['step']}) -> {last['loss']:.4f} "
          f"(step {last['step']}); metrics history and checkpoints under {result.path}", flush=True)
    return {"first_loss": first["loss"], "last_loss": last["loss"], "metrics": result.metrics}


if __name__ == "__main__":
    main()
