"""The checkpoint round trip the resume tests share (`test_checkpoint.py`, `test_zero.py`,
`test_offload.py`, `test_tuning.py`, `test_tied_embeddings.py`, `test_checkpoint_fallback.py`):
train on spawned ranks at a layout, saving in the background and/or resuming from a checkpoint,
and compare with the uninterrupted single-process reference.

fp64 with a 1e-10 relative tolerance (``TOL``); why not fp32: `test_checkpoint.py`'s docstring.
"""

from __future__ import annotations

import os

import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import copy_errors, merge_ranks
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=6, max_grad_norm=1.0, seed=0,
                      lr_schedule="cosine", warmup_steps=2, weight_decay=0.1)
DTYPE = torch.float64
TOL = 1e-10
COLLOCATED_SP2_TP2 = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
DISJOINT_1V_2T = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2)


def _sampler(data, cfg, family=FAMILY):
    """``family``'s sampler over ``data``; it keeps audio clips where the family has an audio
    encoder (the loader's rule for a layout with an audio group, which the Omni cases give it)."""
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.models import family_of

    sampler = StepSampler(read_annotations(data), demo.tiny_processor(family), resolve_data_root(data),
                          cfg.sampler_config())
    sampler.allow_audio = any(e.name == "audio" for e in family_of(demo.tiny_model_config(family)).encoders)
    return sampler


def _text_logits(engine, sample):
    """Logits of the (TP-sharded) language model on a text-only sample, gathered in full."""
    from ray_dhp.data.collate import pad_text_batch

    batch = pad_text_batch([sample], engine.config.text_config.pad_token_id or 0)
    with torch.no_grad():
        out = engine.text_model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                mm_token_type_ids=batch["mm_token_type_ids"], use_cache=False)
    logits = out.logits
    return logits.full_tensor() if hasattr(logits, "full_tensor") else logits


def _train_body(rank, world, layout, cfg, data, model, resume_from, stop, save_at, ckpt_root, probe,
                family=FAMILY):
    """Build the engine at ``layout``, optionally load ``resume_from`` (the engine then built
    unfilled, as the train loop builds it), train until step ``stop`` writing a checkpoint in the
    background at the steps in ``save_at`` (the next steps train while it is written); return
    history, full parameters (also at each save) and probe logits."""
    from ray_dhp.checkpointing import checkpoint
    from ray_dhp.checkpointing.staging import BackgroundWriter
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.parallel.topology import Topology

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(model if model is not None else demo.tiny_model_config(family), groups, cfg.step_config(),
                       dtype=DTYPE, init="checkpoint" if resume_from else "source")
    sampler = _sampler(data, cfg, family)
    first = checkpoint.load(resume_from, engine, sampler) if resume_from else 0
    params0 = engine.named_full_parameters()
    writer = BackgroundWriter(groups.device) if save_at else None
    history, at_save, reserved, drawn = [], {}, None, []
    for _ in range(first, stop):
        batch = sampler.next_step()
        drawn.append([[s.index for s in mb] for mb in batch])
        history.append(engine.step(batch))
        if writer is not None and reserved is None:  # as the built-in loop: after the first step
            writer.reserve(engine)
            reserved = {k: b.data_ptr() for k, b in writer.buffers.items()}
        if engine.step_count in save_at:
            at_save[engine.step_count] = engine.named_full_parameters()
            writer.start(os.path.join(ckpt_root, f"checkpoint_{engine.step_count:06d}"), engine,
                         sampler, processor=demo.tiny_processor(family))
    if writer is not None:
        writer.wait()
        # every save staged into the buffers reserved after the first step: none allocated later
        assert {k: b.data_ptr() for k, b in writer.buffers.items()} == reserved
    logits = _text_logits(engine, probe) if probe is not None and engine.text_model is not None else None
    return {"first": first, "history": history, "params0": params0, "at_save": at_save,
            "params": engine.named_full_parameters(), "logits": logits, "drawn": drawn}


def run(layout, data, *, stop=None, resume_from=None, save_at=(), ckpt_root=None,
        probe=None, model=None, cfg=CFG, family=FAMILY):
    from ray_dhp.parallel.topology import Topology

    world = Topology.build(**layout).world_size
    stop = cfg.optim.num_steps if stop is None else stop
    outs = run_on_ranks(_train_body, world, args=(layout, cfg, data, model, resume_from, stop,
                                                  tuple(save_at), ckpt_root, probe, family))
    logits = next((o["logits"] for o in outs if o["logits"] is not None), None)
    at_save = {k: {n: p for o in outs for n, p in o["at_save"][k].items()} for k in save_at}
    return dict(merge_ranks(outs), first=outs[0]["first"], logits=logits, at_save=at_save,
                drawn=outs[0]["drawn"])


def assert_matches(history, got, ref, *, tol=TOL, loss_tol=None, skip=()):
    """Losses of every step (``loss_tol``, default ``tol``), then every rank's copy of every
    parameter but those named by the suffixes ``skip`` (see parity.copy_errors)."""
    assert len(history) == len(ref["history"])
    loss_tol = tol if loss_tol is None else loss_tol
    for k, (g, r) in enumerate(zip(history, ref["history"])):
        assert abs(g["loss"] - r["loss"]) <= loss_tol * r["loss"], (k, g["loss"], r["loss"])
    assert set(got["params"]) == set(ref["params"])
    errs = copy_errors(got["per_rank"], ref["params"], skip=skip)
    bad = [e for e in errs if e[0] > tol]
    assert not bad, bad
    return max(errs)


def assert_resume_is_exact(before, after, tmp_path, tmp_path_factory):
    """3 steps at layout ``before`` + save + load at ``after`` + 3 steps == 6 uninterrupted
    reference steps (losses, every rank's copy of every parameter, ``TOL``)."""
    data = str(demo.make_dataset(tmp_path_factory.mktemp("data"), num_samples=16, seed=0,
                                 text_only_every=4, image_sizes=((56, 56), (84, 56), (112, 84))))
    from ray_dhp.step.reference import ReferenceTrainer

    sampler = _sampler(data, CFG)
    trainer = ReferenceTrainer(demo.tiny_model_config(FAMILY), CFG.optim, precision=CFG.precision, dtype=DTYPE)
    ref = {"history": [trainer.step(sampler.next_step()) for _ in range(CFG.optim.num_steps)],
           "params": trainer.named_parameters()}
    first = run(before, data, stop=3, save_at=(3,), ckpt_root=str(tmp_path))
    second = run(after, data, resume_from=str(tmp_path))
    assert second["first"] == 3
    assert_matches(first["history"] + second["history"], second, ref)
