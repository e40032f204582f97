"""Video cases shared by the video parity tests (tests/distributed/test_video_parity.py) and the
context-parallel matrix (tests/distributed/test_context_parallel.py)."""

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.data.video import VideoSettings
from ray_dhp.demo.video import moving_square, write_mp4


def long_video_steps(tmp_path, cfg: TrainLoopConfig):
    """One step: a 9 s clip at 4 fps (18 frames sampled at 2 fps: 9 temporal patches of 8x8
    patches, 4 windows of 2x2 merge units per frame at the tiny window_size of 56 px) and a
    text-only sample."""
    import json

    write_mp4(tmp_path / "long.mp4", moving_square("right", 36, (112, 112), side=24), fps=4)
    records = [{"video": "long.mp4", "conversations": [
                   {"from": "human", "value": "<video>\nWhich way does the square move?"},
                   {"from": "gpt", "value": "right"}]},
               {"conversations": [{"from": "human", "value": "Which way can a square move?"},
                                  {"from": "gpt", "value": "left, right, up or down"}]}]
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    side = 112 * 112
    proc = demo.tiny_processor("qwen2_5_vl").configured(
        video=VideoSettings(min_pixels=side, max_pixels=side))
    sampler = StepSampler(read_annotations(path), proc, resolve_data_root(path), cfg.sampler_config())
    return [sampler.next_step() for _ in range(cfg.optim.num_steps)]


LONG_CFG = TrainLoopConfig(lr=1e-3, global_batch_size=2, micro_batches=1, num_steps=1,
                           max_grad_norm=0.5, weight_decay=0.1, seed=0)
