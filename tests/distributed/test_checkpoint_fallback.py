"""A corrupt newest checkpoint makes *every* rank fall back to the same older one.

`checkpoint.load` verifies content hashes collectively: each rank hashes a share of the files,
and the verdict must be everyone's (a rank that decides on its own share alone would load the
corrupt checkpoint while another falls back: different checkpoints on different ranks, then a
hang). The single-process `resolve` is tested in test_checkpoint.py; this is the 2-rank case,
through the public behaviour only: a bit flipped in each file of the newest checkpoint in turn
(whichever rank hashes it), every rank's `load` must return the older checkpoint's step.
"""

import os

import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=2, num_steps=2, seed=0)
LAYOUT = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)


def _flip_bit(path: str) -> bytes:
    """Flip the lowest bit of the middle byte of ``path``; returns the original byte."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        old = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([old[0] ^ 1]))
    return old


def _restore(path: str, old: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(old)


def _body(rank, world, data, root):
    import torch.distributed as dist

    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.checkpointing.integrity import read_meta
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology
    from tests.distributed.checkpoint_cases import _sampler

    groups = build_groups(Topology.build(**LAYOUT), torch.device("cpu"))
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, CFG.step_config())
    sampler = _sampler(data, CFG)
    for _ in range(2):
        engine.step(sampler.next_step())
        checkpoint.save(os.path.join(root, f"checkpoint_{engine.step_count:06d}"), engine, sampler)
    dist.barrier()  # rank 0 commits after the others return from `save` (Ray's report is the barrier)
    newest = os.path.join(root, "checkpoint_000002")
    loaded = {"(intact)": checkpoint.load(root, engine)}
    for name in sorted(read_meta(newest)["files"]):
        dist.barrier()
        if rank == 0:
            old = _flip_bit(os.path.join(newest, name))
        dist.barrier()
        loaded[name] = checkpoint.load(root, engine)
        dist.barrier()
        if rank == 0:
            _restore(os.path.join(newest, name), old)
    return loaded


def test_a_bit_flip_any_rank_hashes_makes_every_rank_fall_back(tmp_path):
    data = str(demo.make_dataset(tmp_path / "data", num_samples=4, seed=0, text_only_every=2,
                                 image_sizes=((56, 56),)))
    root = str(tmp_path / "ckpts")
    outs = run_on_ranks(_body, 2, args=(data, root), timeout_s=300)
    assert len(outs[0]) >= 3, outs[0]  # the intact load + at least two files corrupted in turn
    for rank, loaded in enumerate(outs):
        assert loaded["(intact)"] == 2, rank
        wrong = {name: step for name, step in loaded.items() if name != "(intact)" and step != 1}
        assert not wrong, f"rank {rank} loaded the corrupt newest checkpoint after a bit flip in {wrong}"
    assert all(loaded == outs[0] for loaded in outs), outs  # the same checkpoint on every rank
