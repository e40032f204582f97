"""Megatron sequence parallelism for the language model: the seams DTensor styles cannot see.

The plan itself (``ray_dhp.models.base.sequence_parallel_text_plan``) is parallel styles only
(DTensor's, and ``ray_dhp.parallel.seq_gather``'s for the column-parallel projections, which keep
only the sequence shard for backward). What is left here is model glue that runs between the
styled modules:

* deepstack (`FamilySpec.num_deepstack` > 0): after each of the first decoder layers the model
  adds vision features at the image-token positions
  (``_deepstack_process(hidden, visual_pos_masks, embeds)``) with the *full* ``[B, S]`` mask and
  all image rows, while the hidden states are this rank's sequence shard ``[B, S / tp, D]``.
  ``install_deepstack_shard`` gives the text model an instance-level ``_deepstack_process`` that
  slices the mask to the local positions and picks the matching feature rows. Every TP rank
  holds all feature rows but adds only its own, so the deepstack features enter through
  ``_copy_to_tp`` (Megatron's "f": identity forward, all-reduce SUM over the TP group backward):
  every rank, and TP rank 0 which returns the feature gradients to the vision group, then holds
  the whole gradient.
* the sequence length must be a multiple of tp: the engine pads (``pad_multiple``).
"""

from __future__ import annotations

import types

import torch
import torch.distributed as dist

from ray_dhp.parallel.comm import record

__all__ = ["install_deepstack_shard", "local_visual_rows", "pad_multiple"]


def pad_multiple(tp: int, sequence_parallel: bool) -> int:
    """The multiple the text sequence length is padded to (1 without sequence parallelism)."""
    return tp if sequence_parallel else 1


def local_visual_rows(visual_pos_masks: torch.Tensor, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For a ``[B, S]`` mask of image positions and a local sequence slice ``[lo, hi)``: the local
    ``[B, hi - lo]`` mask and the indices of its True entries among the full mask's True entries
    (row-major order, the order of the feature rows)."""
    rank_of = torch.cumsum(visual_pos_masks.reshape(-1).long(), 0).view_as(visual_pos_masks) - 1
    local = visual_pos_masks[:, lo:hi]
    return local, rank_of[:, lo:hi][local]


class CopyToTP(torch.autograd.Function):
    """Identity forward; backward all-reduces (SUM) the gradient over the TP group (recorded
    under ``label``): the input of a TP region whose ranks each use all of it."""

    @staticmethod
    def forward(ctx, x, group, comm, label):
        ctx.group, ctx.comm, ctx.label = group, comm, label
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        record(ctx.comm, "all_reduce", ctx.label, grad)
        return grad, None, None, None


def _deepstack_shard(self, hidden_states, visual_pos_masks, visual_embeds):
    group, comm = self._ray_dhp_sp
    rank = dist.get_rank(group)
    s_local = hidden_states.shape[1]
    mask, rows = local_visual_rows(visual_pos_masks.to(hidden_states.device), rank * s_local, (rank + 1) * s_local)
    visual_embeds = CopyToTP.apply(visual_embeds.to(hidden_states.device, hidden_states.dtype), group, comm,
                                   "text.sp_deepstack")
    visual_embeds = visual_embeds[rows.to(hidden_states.device)]
    hidden_states = hidden_states.clone()
    hidden_states[mask, :] = hidden_states[mask, :] + visual_embeds
    return hidden_states


def install_deepstack_shard(text_model: torch.nn.Module, tp_group, comm=None) -> None:
    """Make ``text_model._deepstack_process`` act on the local sequence shard (this instance only);
    ``comm`` counts the backward all-reduces as ``("all_reduce", "text.sp_deepstack")``."""
    if not hasattr(text_model, "_deepstack_process"):
        raise ValueError(f"{type(text_model).__name__} has no _deepstack_process to shard")
    text_model._ray_dhp_sp = (tp_group, comm)
    text_model._deepstack_process = types.MethodType(_deepstack_shard, text_model)
