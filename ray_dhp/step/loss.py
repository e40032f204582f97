"""The training loss as a pluggable function, exact under text tensor parallelism.

`DHPEngine.forward_backward(micro_batches, loss_fn=...)` calls ``loss_fn(inputs)`` once per
micro-batch on every text rank, with a `LossInputs` describing the rows this text replica
computed, and back-propagates the scalar it returns. The contract (docs/custom_loop.md):

* the return value is this replica's **contribution** to the step's loss: the step's loss is the
  sum of the contributions of every micro-batch and every text data-parallel replica (and, with
  ``text.context_parallel``, of every CP rank: each gets its slice of the positions,
  `ray_dhp.parallel.context`). So the
  loss must be a sum of per-sample terms; normalise by the step's global counts
  (``inputs.num_targets``, ``inputs.num_samples``), never by a count of this replica's rows
  (which depends on the layout);
* every tensor parallel rank of a replica calls it with the same inputs and must return the same
  value. Build it from the exact per-token statistics `LossInputs` offers — ``token_loss()``
  (cross-entropy of the target), ``logsumexp()``, ``mean_logit()`` — plain ``[R, L]`` tensors
  with autograd, identical on every TP rank, combined with ``targets``, ``mask``,
  ``sample_ids`` and ``samples`` as you like (weights, label smoothing, z-loss, ...).
  ``F.cross_entropy`` on ``inputs.logits`` also works (the engine calls the function under
  ``loss_parallel``), but nothing else on the logits: under text TP they are vocab-sharded
  DTensors (``Shard(-1)``), ops mixing them with plain tensors fail, and inside
  ``loss_parallel`` ``F.log_softmax``'s backward is a pass-through made for ``nll_loss`` only,
  so a loss built on it would get silently wrong gradients.

The statistics are computed on the vocab shards and summed over the TP ranks: no rank gathers
the vocabulary.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F

__all__ = ["LossInputs", "LossFn", "cross_entropy_loss", "sample_ids_of", "backward_loss"]

IGNORE_INDEX = -100


@dataclass
class LossInputs:
    """What a loss function gets for one micro-batch on one text replica.

    Attributes:
        logits: ``[R, L, V]`` logits of this replica's rows, in at least fp32; under text tensor
            parallelism a DTensor sharded over the vocabulary (``Shard(-1)``).
        targets: ``[R, L]`` next-token targets (token ids), -100 where a position has no
            target (prompt, padding, a sample's last token).
        sample_ids: ``[R, L]`` index into ``samples`` of each position's sample, -1 on padding
            (one sample per row when padded; several per row when packed).
        samples: this replica's samples of the micro-batch (`ray_dhp.data.Sample`).
        num_targets: the number of targets in the whole step (all micro-batches, all replicas).
        num_samples: the number of samples in the whole step (all micro-batches, all replicas).
    """

    logits: torch.Tensor
    targets: torch.Tensor
    sample_ids: torch.Tensor
    samples: list
    num_targets: int
    num_samples: int
    _token_loss: Optional[torch.Tensor] = field(default=None, repr=False)

    def token_loss(self) -> torch.Tensor:
        """``[R, L]`` cross-entropy of every position's target (0 where there is none), a plain
        tensor with autograd, identical on every TP rank (computed on the vocab shards)."""
        if self._token_loss is None:
            flat = F.cross_entropy(self.logits.flatten(0, 1), self.targets.flatten(),
                                   ignore_index=IGNORE_INDEX, reduction="none")
            if _is_dtensor(flat):  # Replicate over the TP mesh: every rank holds all of it
                flat = flat.to_local()
            self._token_loss = flat.view(self.targets.shape)
        return self._token_loss

    def logsumexp(self) -> torch.Tensor:
        """``[R, L]`` log-sum-exp of the logits over the vocabulary (e.g. a z-loss), a plain
        tensor with autograd, exact under TP: computed on the vocab shards, then summed over
        the TP ranks (no rank gathers the vocabulary)."""
        local, reduce_sum = _vocab_shards(self.logits)
        top = local.detach().amax(-1)
        top = _reduce_max(top, self.logits)
        return top + torch.log(reduce_sum(torch.exp(local - top[..., None]).sum(-1)))

    def mean_logit(self) -> torch.Tensor:
        """``[R, L]`` mean of the logits over the vocabulary, exact under TP like `logsumexp`
        (``logsumexp() - mean_logit()`` is the cross-entropy against the uniform distribution:
        label smoothing)."""
        local, reduce_sum = _vocab_shards(self.logits)
        return reduce_sum(local.sum(-1)) / self.logits.shape[-1]

    @property
    def mask(self) -> torch.Tensor:
        """``[R, L]`` bool: the positions that have a target."""
        return self.targets != IGNORE_INDEX


LossFn = Callable[[LossInputs], torch.Tensor]


def cross_entropy_loss(inputs: LossInputs) -> torch.Tensor:
    """The default loss: token-level cross-entropy summed over the targets and divided by the
    step's target count (each target token weighs the same, whatever its sample)."""
    loss_sum = F.cross_entropy(inputs.logits.flatten(0, 1), inputs.targets.flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum / inputs.num_targets


def sample_ids_of(batch: dict, samples) -> torch.Tensor:
    """``[R, L]`` sample index per position of a text batch: a packed batch's own
    ``sample_ids``; for a padded batch (row ``i`` = sample ``i``), ``i`` on the sample's tokens
    and -1 on the padding after them."""
    if batch.get("sample_ids") is not None:
        return batch["sample_ids"]
    rows, length = batch["input_ids"].shape
    lengths = torch.tensor([s.num_tokens for s in samples])
    ids = torch.arange(rows)[:, None].expand(rows, length).clone()
    ids[torch.arange(length)[None, :] >= lengths[:, None]] = -1
    return ids


def backward_loss(loss_fn: Optional[LossFn], inputs: LossInputs, tensor_parallel: bool,
                  extra: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Call ``loss_fn`` (default `cross_entropy_loss`) under ``loss_parallel`` when the logits
    are vocab-sharded, back-propagate its value, and return it as a detached fp64 scalar on its
    device (no host sync per micro-batch: the step reads the sum once). ``extra``: a plain
    scalar added to the loss and back-propagated with it (a MoE router's load-balancing term,
    `ray_dhp.models.moe`)."""
    loss_fn = loss_fn or cross_entropy_loss
    ctx = contextlib.nullcontext()
    if tensor_parallel:
        from torch.distributed.tensor.parallel import loss_parallel

        ctx = loss_parallel()
    with ctx:
        loss = loss_fn(inputs)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError(f"loss_fn must return a scalar tensor, got {type(loss).__name__} "
                             f"{tuple(getattr(loss, 'shape', ()))}")
        roots = [t for t in (loss, extra) if t is not None and t.requires_grad]
        if roots:  # not with a frozen LLM and a micro-batch without images
            torch.autograd.backward(roots)
    value = loss.full_tensor() if _is_dtensor(loss) else loss
    value = value.detach().double().reshape(())
    return value if extra is None else value + extra.detach().double().reshape(())


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce SUM of per-rank partial sums over the TP group; backward: identity
    (the loss built on the sum is replicated on every TP rank, so each rank's partial sum gets
    the same gradient, which is the gradient of the one loss)."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _vocab_shards(logits: torch.Tensor):
    """(this rank's vocab shard of ``logits`` as a plain tensor with autograd, a function that
    sums a per-rank partial result over the shards)."""
    if not _is_dtensor(logits):
        return logits, lambda t: t
    group = logits.device_mesh.get_group()
    return logits.to_local(), lambda t: _SumOverRanks.apply(t, group)


def _reduce_max(t: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Element-wise max over the TP ranks (no gradient: only used to shift exponentials)."""
    if not _is_dtensor(logits):
        return t
    import torch.distributed as dist

    t = t.clone()
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=logits.device_mesh.get_group())
    return t


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)
