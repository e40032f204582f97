"""The distributed step loader: each sample decoded once across the cluster, pixels only where
they are computed, and the same steps as the single-process sampler (issue #4)."""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.parallel.topology import EncoderDegrees, Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.spawn import run_on_ranks

STEPS = 3
BAD = [(2, "missing_image"), (5, "malformed_json"), (9, "corrupt_image")]


def _sampler(path, **cfg):
    return StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path),
                       TrainLoopConfig(**cfg).sampler_config())


def _balancer(cfg):
    """The engine's balancer for the demo model (``cfg["balance"]``, default "cost")."""
    from ray_dhp.step.microbatch import balancer_for

    return balancer_for(TrainLoopConfig(**cfg).optim.balance, demo.tiny_model_config())


def _summary(micro_batches):
    """Per micro-batch, per sample: (index, ids, labels, grid, has pixels, pixel sum)."""
    return [[(s.index, s.input_ids.tolist(), s.labels.tolist(),
              None if s.image_grid_thw is None else s.image_grid_thw.tolist(),
              s.pixel_values is not None,
              None if s.pixel_values is None else float(s.pixel_values.double().sum()))
             for s in mb] for mb in micro_batches]


def _body(rank, world, path, layout, cfg, prefetch):
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    topo = Topology.build(**layout)
    groups = build_groups(topo, torch.device("cpu"))
    loader = StepLoader(_sampler(path, **cfg), groups, prefetch=prefetch, balancer=_balancer(cfg))
    loader.start(STEPS)
    steps = [_summary(loader.next()) for _ in range(STEPS)]
    return {"steps": steps, "processed": loader.processed_here, "state": loader.state_dict(),
            "skipped": loader.skipped, "vision": groups.vision_coord, "text": groups.text_coord}


def _reference(path, cfg, replicas=(1, 1)):
    s = _sampler(path, **cfg)
    s.replicas, s.balancer = replicas, _balancer(cfg)
    raw = [s.next_step() for _ in range(STEPS)]
    return [_summary(st) for st in raw], s.state_dict(), s.skipped, raw


LAYOUTS = {
    "collocated_sp2_tp2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2),
    "disjoint_1v_1t": dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1),
    "collocated_sp2dp2_tp2dp2": dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2,
                                     text_tp=2),
}


@pytest.mark.parametrize("name, prefetch, budget, balance", [
    ("collocated_sp2_tp2", True, None, "cost"), ("disjoint_1v_1t", True, None, "cost"),
    pytest.param("collocated_sp2dp2_tp2dp2", False, None, "cost", marks=pytest.mark.slow),
    ("collocated_sp2dp2_tp2dp2", True, 75, "cost"),
    pytest.param("collocated_sp2dp2_tp2dp2", True, None, "count", marks=pytest.mark.slow)])
def test_loader_decodes_once_and_matches_the_sampler(tmp_path, name, prefetch, budget, balance):
    path = demo.make_dataset(tmp_path / "d", num_samples=14, text_only_every=4, bad_lines=BAD)
    cfg = dict(global_batch_size=4, micro_batches=2, seed=1, balance=balance)
    if budget is not None:  # token-budget micro-batches: sizes vary from step to step
        cfg = dict(global_batch_size=8, micro_batch_tokens=budget, seed=1, balance=balance)
    layout = LAYOUTS[name]
    world = 4 if name.endswith("dp2") else 2
    out = run_on_ranks(_body, world, (str(path), layout, cfg, prefetch))
    replicas = (layout["text_dp"], max(layout["text_dp"], layout["vision_dp"]))
    ref_steps, ref_state, ref_skipped, raw = _reference(path, cfg, replicas)
    # Every rank sees the single-process sampler's steps (same records, ids, labels, grids);
    # pixels, where present, are the sampler's own.
    for r in out:
        assert r["state"] == ref_state and r["skipped"] == ref_skipped == 3
        for got, want in zip(r["steps"], ref_steps):
            assert [[g[:4] for g in mb] for mb in got] == [[w[:4] for w in mb] for mb in want]
            assert all(g[5] == w[5] for gm, wm in zip(got, want) for g, w in zip(gm, wm) if g[4])
    if budget is not None:
        sizes = [len(mb) for step in ref_steps for mb in step]
        assert len(set(sizes)) > 1 and min(sizes) >= 2, sizes  # varying, every replica fed
    # Each record was processed once across the cluster: the ranks together process exactly what
    # one process running the loader alone processes (every draw once; known-bad records are
    # not processed again), not world x that.
    from ray_dhp.data.loader import StepLoader

    alone = StepLoader(_sampler(path, **cfg), prefetch=False, balancer=_balancer(cfg))
    alone.sampler.replicas = replicas
    for _ in range(STEPS):
        alone.next()
    assert sum(r["processed"] for r in out) == alone.processed_here
    assert alone.processed_here >= STEPS * cfg["global_batch_size"] + ref_skipped
    assert all(r["processed"] > 0 for r in out)  # the work is spread over every rank
    # Pixels live exactly on the vision ranks of the replica the engine's layout assigns the
    # sample (by cost: not the contiguous split).
    from ray_dhp.step.engine import layout_micro_batch
    from ray_dhp.parallel.topology import Topology

    topo, vc = Topology.build(**layout), demo.tiny_model_config().vision_config
    for r in out:
        for step, raw_step in zip(r["steps"], raw):
            for mb, raw_mb in zip(step, raw_step):
                lay = layout_micro_batch(raw_mb, topo, "qwen2_5_vl", vc, _balancer(cfg))
                owner = {k: i for i, idx in enumerate(lay.vision_samples) for k in idx}
                for slot, s in enumerate(mb):
                    if s[3] is None:
                        assert not s[4]
                        continue
                    want = r["vision"] is not None and r["vision"][0] == owner[slot]
                    assert s[4] == want, (r["vision"], slot)


def test_cost_balance_needs_the_engines_balancer_with_encoder_dp(tmp_path):
    from ray_dhp.data.loader import StepLoader

    class _Groups:
        topology = Topology.build(**LAYOUTS["collocated_sp2dp2_tp2dp2"])

    path = demo.make_dataset(tmp_path / "d", num_samples=4)
    with pytest.raises(ValueError, match="engine's balancer"):
        StepLoader(_sampler(path, global_batch_size=4), _Groups())

    class _AudioGroups:  # any encoder with several replicas: here audio DP2 beside vision DP1
        topology = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1,
                                  text_tp=2, encoders={"audio": EncoderDegrees(dp=2)})

    with pytest.raises(ValueError, match="audio data_parallel > 1 needs the engine's balancer"):
        StepLoader(_sampler(path, global_batch_size=4), _AudioGroups())


def _strict_body(rank, world, path, layout):
    from ray_dhp.data.loader import StepLoader
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    loader = StepLoader(_sampler(path, global_batch_size=8, bad_data="strict"), groups)
    loader.start(1)
    try:
        loader.next()
    except ValueError as e:
        return str(e)
    return None


def test_strict_mode_fails_on_every_rank_naming_the_line(tmp_path):
    path = demo.make_dataset(tmp_path / "d", num_samples=8, bad_lines=[(4, "corrupt_image")])
    out = run_on_ranks(_strict_body, 2, (str(path), LAYOUTS["disjoint_1v_1t"]))
    assert all(msg is not None and "data.jsonl:5" in msg and "corrupt image" in msg for msg in out), out
