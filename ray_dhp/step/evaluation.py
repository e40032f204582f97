"""Evaluation: the loss over a validation set under the training layout, forward only.

`evaluate(engine, batches)` runs, for every micro-batch, the engine's own forward phases — vision
forward (Ulysses SP within each vision replica), the boundary hand-off to the text layout — and
then the text forward with the vocab-parallel cross-entropy, without backward: no graph is kept
(``torch.no_grad``), no gradient, optimizer, scheduler or step counter is touched. The modules are
in eval mode meanwhile (no dropout) and the random state is restored afterwards, so training after
an evaluation is bit-identical to training without it.

The result is token-weighted like the training ``loss``: the summed cross-entropy of every target
token of the set over the number of target tokens (the single-process model's loss on the whole
set, up to summation order).
"""

from __future__ import annotations

import contextlib
from typing import Iterable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_dhp.step.microbatch import _MicroBatch, count_targets, shift_labels, upcast
from ray_dhp.parallel import boundary as bnd

__all__ = ["evaluate", "check_eval_setup", "EVAL_METRICS", "VALIDATION"]

#: The dataset the built-in loop evaluates on (``datasets={"validation": ...}``).
VALIDATION = "validation"
#: What an evaluation adds to the step's report.
EVAL_METRICS = ("eval_loss", "eval_tokens", "eval_samples", "time_eval_s")


def evaluate(engine, batches: Iterable[list]) -> dict:
    """The validation loss of ``engine``'s current weights (collective on every rank).

    Args:
        engine: this rank's `ray_dhp.step.engine.DHPEngine`.
        batches: an iterable of micro-batch lists (each a list of lists of `Sample`, the same on
            every rank, as `ray_dhp.data.eval_loader.EvalLoader.batches` yields them).

    Returns:
        ``{"eval_loss": mean cross-entropy per target token, "eval_tokens": target tokens,
        "eval_samples": samples evaluated}`` (the same on every rank; ``eval_loss`` is NaN when
        the set has no target token).
    """
    g = engine.groups
    # every module this rank hosts: its encoders (vision, audio, ...) and the LM
    modules = [m for m in (*engine.shards.values(), engine.text_model) if m is not None]
    was_training = [m.training for m in modules]
    cuda = [g.device] if g.device.type == "cuda" else []
    loss_sum = torch.zeros((), dtype=torch.float64)
    n_targets = n_samples = 0
    with torch.random.fork_rng(devices=cuda), torch.no_grad(), _eval_mode(modules, was_training):
        for micro_batches in batches:
            for samples in micro_batches:
                n_targets += count_targets(samples)
                n_samples += sum(1 for s in samples if s.index >= 0)  # ghosts: index -1
                loss_sum += _loss_sum(engine, samples)
    stats = torch.tensor([float(loss_sum)], dtype=torch.float64, device=g.device)
    dist.all_reduce(stats)  # the text leaders' sums (every other rank adds 0)
    loss = stats[0].item() / n_targets if n_targets else float("nan")
    return {"eval_loss": loss, "eval_tokens": n_targets, "eval_samples": n_samples}


@contextlib.contextmanager
def _eval_mode(modules: list, was_training: list):
    for m in modules:
        m.eval()
    try:
        yield
    finally:
        for m, mode in zip(modules, was_training):
            m.train(mode)


def _loss_sum(engine, samples: list) -> torch.Tensor:
    """This rank's share of one micro-batch's summed loss: the text replica's sum on its TP rank
    0, zero elsewhere (so one all-reduce over all ranks counts each sample once)."""
    mb = _MicroBatch(samples)
    engine._inflight = bnd.InFlight()
    engine._vision_fwd(mb, 0)      # layout + vision forward (no graph under no_grad)
    engine._send_features(mb, 0)   # boundary: my text rows of the features
    engine._inflight.wait()
    g = engine.groups
    if not g.is_text:
        return torch.zeros((), dtype=torch.float64)
    mine = [samples[i] for i in mb.lay.text_samples[g.text_coord[0]]]
    value = _text_loss_sum(engine, mine, mb.text_feats)
    leader = g.text_coord[1] == 0
    return value if leader else torch.zeros((), dtype=torch.float64)


def _text_loss_sum(engine, samples: list, feats) -> torch.Tensor:
    """The text forward of `DHPEngine._text_forward_backward` (`DHPEngine._text_logits`),
    without backward: the summed cross-entropy of ``samples``' targets (vocab-parallel under TP),
    as a float64 CPU scalar."""
    batch, _, logits = engine._text_logits(samples, feats)
    targets = batch["targets"] if "targets" in batch else shift_labels(batch["labels"])
    ctx = contextlib.nullcontext()
    if engine.groups.topology.text.inner > 1:  # vocab-sharded logits
        from torch.distributed.tensor.parallel import loss_parallel

        ctx = loss_parallel()
    with ctx:
        loss_sum = F.cross_entropy(upcast(logits).flatten(0, 1),
                                   targets.to(engine.groups.device).flatten(),
                                   ignore_index=-100, reduction="sum")
    value = loss_sum.full_tensor() if hasattr(loss_sum, "full_tensor") else loss_sum
    return value.detach().double().cpu()


def check_eval_setup(data, checkpoint, *, has_validation: bool, name, score_attribute=None,
                     validation_key: str = 'datasets["validation"]',
                     score_key: str = "run_config.checkpoint_config.checkpoint_score_attribute"
                     ) -> None:
    """Before any worker starts: a ConfigError (a ValueError) naming the keys when the evaluation
    settings contradict each other.

    - ``eval_every`` > 0 needs a validation set;
    - the validation set is not trained on (``dataset_weights`` must not name it);
    - checkpoints ranked by an evaluation metric (``score_attribute`` "eval_loss"...) need a
      validation set and an evaluation at every checkpoint step: ``checkpoint_every`` a multiple
      of ``eval_every`` (Ray Train V2 ranks a checkpoint reported without the attribute as the
      *best* under ``checkpoint_score_order="min"``, so a missing value must not happen).

    Args:
        data, checkpoint: the run's ``data`` and ``checkpoint`` sections
            (`ray_dhp.config.data_section.DataConfig`, `ray_dhp.config.sections.CheckpointConfig`).
        has_validation: whether the run has a dataset named "validation".
        score_attribute: ``CheckpointConfig.checkpoint_score_attribute`` (None: by recency).
        name: how a loop key is called in messages (``name("eval_every")``: the tree's
            `TrainLoopConfig.key` from Python, the key's path in a run file).
        validation_key, score_key: how the validation set and the score attribute are called.
    """
    from ray_dhp.config.checks import ConfigError

    if data.eval_every > 0 and not has_validation:
        raise ConfigError(f"{name('eval_every')}={data.eval_every} evaluates on a validation set, "
                          f"but there is none: set {validation_key} (or eval_every=0).")
    if VALIDATION in (data.dataset_weights or {}):
        raise ConfigError(f"{name('dataset_weights')}: names {VALIDATION!r}, the evaluation set; "
                          "training on it makes eval_loss meaningless (give a dataset to train "
                          "on another name).")
    if not isinstance(score_attribute, str):
        return
    if score_attribute not in EVAL_METRICS:
        import difflib

        near = difflib.get_close_matches(score_attribute, EVAL_METRICS, n=1, cutoff=0.8)
        if score_attribute.startswith("eval_") or near:  # a misspelt evaluation metric
            raise ConfigError(f"{score_key}={score_attribute!r} is not reported"
                              + (f"; did you mean {near[0]!r}?" if near else "")
                              + f" (an evaluation reports {list(EVAL_METRICS)}).")
        return
    if not has_validation:
        raise ConfigError(f"{score_key}={score_attribute!r} ranks checkpoints by an evaluation "
                          f"metric, but there is no validation set: set {validation_key}.")
    every, ck = data.eval_every, checkpoint.checkpoint_every
    if ck > 0 and (every == 0 or ck % every):
        when = "only at the end" if every == 0 else f"every {every} steps"
        raise ConfigError(
            f"{score_key}={score_attribute!r} ranks checkpoints by an evaluation metric, so each "
            f"checkpoint step needs an evaluation: {name('checkpoint_every')}={ck} must be a "
            f"multiple of {name('eval_every')}={every} (evaluations run {when}); e.g. set "
            f"eval_every={ck}.")
