"""Evaluation (issue #14): the eval loss over the whole validation set under the DHP layout equals
the single-process model's loss on that set, and evaluating does not change training.

Each case trains 2 steps; the engine evaluates before training and after every step (through the
real `EvalLoader`: decode owners, pixel routing, ghosts in partial batches), the reference
computes the stock transformers model's summed cross-entropy over every valid validation sample
at the same weights. The validation set has 7 records, two of them
text-only and one bad (skipped, not replaced), in batches of 3 records: 2, 3 and 1 valid samples;
with DP2 the batch of 1 cannot feed both replicas and a ghost fills it. A slow case cuts the
batches by a token budget instead (several micro-batches per batch); another trains and evaluates
on packed rows (`data.packing`, rows of 80 tokens: the evaluation forward runs the packed rows as
training does, and equals the reference's one sample per forward).

Tolerance: fp64, 1e-10 relative (as the parity matrix, see tests/distributed/test_parity.py): the
only differences are summation orders (~1e-14). Training with evaluations must be *bit-identical*
to training without them (same process, same seed): losses, grad norms and every parameter.
Every sub-module is back in training mode after every evaluation (checked directly: with the
tiny models' dropout 0, no number would show a module left in eval mode).
"""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from ray_dhp import demo
from ray_dhp.data.collate import pad_text_batch
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.data.sampler import StepSampler
from ray_dhp.step.engine import count_targets, shift_labels
from ray_dhp.step.reference import ReferenceTrainer
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps
from tests.spawn import run_on_ranks

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, eval_batch_size=3)
FAMILY = "qwen2_5_vl"
BAD = 1  # the validation record whose image is missing


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eval")
    steps = make_steps(tmp, FAMILY, CFG, num_samples=8)
    val = demo.make_dataset(tmp / "val", num_samples=7, seed=5, text_only_every=3,
                            bad_lines=[(BAD, "missing_image")])
    return steps, val, _reference(steps, val)


def _val_sampler(path, cfg=CFG):
    return StepSampler(read_annotations(path), demo.tiny_processor(FAMILY), resolve_data_root(path), cfg.sampler_config())


def _reference(steps, val) -> dict:
    """The stock model's eval loss on the valid validation samples, before and after each step."""
    s = _val_sampler(val)
    samples = [x for x in (s.process(i) for i in range(len(s.records))) if not isinstance(x, Exception)]
    assert len(samples) == 6  # one bad record left out
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), CFG.optim, precision=CFG.precision, dtype=torch.float64)
    losses, history = [_ref_eval(ref, samples)], []
    for mbs in steps:
        history.append(ref.step(mbs))
        losses.append(_ref_eval(ref, samples))
    return {"eval": losses, "targets": count_targets(samples), "history": history}


def _ref_eval(ref, samples) -> float:
    total = 0.0
    with torch.no_grad():
        for s in samples:  # one sample per forward: no padding anywhere
            batch = pad_text_batch([s], ref.config.text_config.pad_token_id or 0)
            kw = {k: v for k, v in batch.items() if v is not None and k != "labels"}
            if "pixel_values" in kw:
                kw["pixel_values"] = kw["pixel_values"].to(torch.float64)
            logits = ref.model(**kw, use_cache=False).logits
            total += float(F.cross_entropy(logits.flatten(0, 1), shift_labels(batch["labels"]).flatten(),
                                           ignore_index=-100, reduction="sum"))
    return total / count_targets(samples)


def _modes(engine) -> dict:
    return {f"{side}.{n}": m.training for side, module in (("vision", engine.visual),
                                                            ("text", engine.text_model))
            if module is not None for n, m in module.named_modules()}


def _body(rank, world, layout, steps, val, val_cfg, cfg=CFG):
    from ray_dhp.data.eval_loader import EvalLoader
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    model = demo.tiny_model_config(FAMILY)
    with_eval = DHPEngine(model, groups, cfg.step_config(), dtype=torch.float64)
    plain = DHPEngine(model, groups, cfg.step_config(), dtype=torch.float64)
    loader = EvalLoader(_val_sampler(val, val_cfg), groups, batch_size=val_cfg.eval_batch(),
                        balancer=with_eval.balancer())
    modes = [_modes(with_eval)]  # every sub-module's `training` flag, before/after each evaluation
    evals = [with_eval.evaluate(loader.batches())]
    modes.append(_modes(with_eval))
    history, plain_history = [], []
    for mbs in steps:
        history.append(with_eval.step(mbs))
        evals.append(with_eval.evaluate(loader.batches()))
        modes.append(_modes(with_eval))
        plain_history.append(plain.step(mbs))
    a, b = with_eval.named_full_parameters(), plain.named_full_parameters()
    identical = all(torch.equal(a[n], b[n]) for n in a) and a.keys() == b.keys()
    keep = ("loss", "grad_norm", "lr")
    return {"evals": evals, "identical_params": identical,
            "history": [{k: h[k] for k in keep} for h in history],
            "plain_history": [{k: h[k] for k in keep} for h in plain_history],
            "skipped": loader.skipped, "modes": modes,
            "micro_batches": [len(mbs) for mbs in loader.batches()]}


# the validation set as one batch cut by a token budget: 40 tokens per text replica and
# micro-batch hold one sample (30-37 tokens with the chat template) each, never two, so 3
# micro-batches of 2 samples at DP2
BUDGET = TrainLoopConfig(global_batch_size=4, micro_batch_tokens=40, eval_batch_size=7)
# training and evaluation on packed rows of 80 tokens (samples of 30-43 tokens: 2 a row)
PACKED = replace(CFG, packing=True, max_tokens=80)

LAYOUTS = {
    "collocated-sp2-tp2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2),
    "disjoint-1v-2t": dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2),
    "collocated-dp2": dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1),
    "collocated-dp2-budget": dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2,
                                  text_tp=1),
    # ZeRO stage 3 for both modules: FSDP2's all-gathers in every evaluation forward, the ViT's
    # on a replica without images too (`ray_dhp.models.fsdp_vision`)
    "collocated-dp2-stage3": dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2,
                                  text_tp=1, vision_zero=3, text_zero=3),
    # the LM's context parallelism: each CP rank sums its slice's targets (`ray_dhp.parallel.context`)
    "collocated-sp2-cp2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1,
                               text_tp=1, text_cp=2),
    # packed rows (`PACKED`), train and evaluate
    "collocated-sp2-tp2-packed": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1,
                                      text_tp=2),
}
SLOW = ("budget", "stage3", "cp2", "packed")


@pytest.mark.parametrize("name", [pytest.param(n, marks=(pytest.mark.slow,) if n.endswith(SLOW) else ())
                                  for n in LAYOUTS])
def test_eval_loss_matches_reference_and_leaves_training_unchanged(name, data):
    steps, val, ref = data
    layout = LAYOUTS[name]
    cfg = PACKED if name.endswith("packed") else CFG
    val_cfg = BUDGET if name.endswith("budget") else cfg
    outs = run_on_ranks(_body, Topology.build(**layout).world_size,
                        args=(layout, steps, val, val_cfg, cfg))
    if name.endswith("budget"):
        assert outs[0]["micro_batches"] == [3], outs[0]["micro_batches"]
    for rank, out in enumerate(outs):
        assert out["skipped"] == 1, rank
        # training mode (dropout, anything that reads `training`) back on every sub-module after
        # every evaluation: at this size no number shows it (dropout 0)
        before, *after = out["modes"]
        assert before and all(before.values()), (rank, [n for n, t in before.items() if not t][:5])
        for k, modes in enumerate(after):
            left = sorted(n for n in before if modes.get(n) != before[n])
            assert not left, f"rank {rank}: after evaluation {k + 1}, not in training mode: {left[:5]}"
        for k, (got, want) in enumerate(zip(out["evals"], ref["eval"], strict=True)):
            assert got["eval_samples"] == 6 and got["eval_tokens"] == ref["targets"], (rank, got)
            assert abs(got["eval_loss"] - want) / want < 1e-10, (rank, k, got["eval_loss"], want)
        # evaluating changed nothing: bit-identical losses, norms and parameters
        assert out["history"] == out["plain_history"], rank
        assert out["identical_params"], rank
        for got, want in zip(out["history"], ref["history"], strict=True):
            assert abs(got["loss"] - want["loss"]) / want["loss"] < 1e-10
    # the weights moved, so the eval loss did too: the evaluations saw the current weights
    assert len({round(e["eval_loss"], 12) for e in outs[0]["evals"]}) == len(ref["eval"])
