"""Column-parallel linears that read an all-gathered sequence and keep only its shard (Megatron).

Under Megatron sequence parallelism the input of the column-parallel projections (attention
q/k/v, MLP gate/up, ``lm_head``) is all-gathered along the sequence. DTensor's
``PrepareModuleInput`` + ``ColwiseParallel`` let each matmul save that *gathered* input for its
weight gradient: ``S`` tokens per rank, not ``S / tp`` (the TP-1 cost of those tensors). Megatron-LM
(Korthikanti et al. 2022, section 4.2.2) saves the sequence shard instead and all-gathers it
again in backward. `GatheredColwise` does that with the DTensor machinery:

* the weights are sharded exactly like ``ColwiseParallel`` (``Shard(0)`` DTensor parameters), so
  optimizer, checkpoints, grad-norm and loading see the same parameters;
* a pre-hook on the module that owns the linears all-gathers its sequence-sharded input once
  (a differentiable DTensor redistribute ``Shard(1) -> Replicate``; its backward reduce-scatters
  the summed input gradient of all sibling linears);
* each linear runs `_ColumnFromGathered`: forward ``x_full @ W_local^T + b_local``, saving only
  the shard and the local weight; backward re-gathers the shard once per sibling group
  (`_Regather`: the first backward gathers, the last one drops it) for the weight gradient.

The collectives are DTensor redistributes on the TP mesh (tensors on the mesh's device: NCCL
and gloo alike). Everything saved goes through ``save_for_backward``, so non-reentrant activation
checkpointing drops and recomputes it like any other saved tensor.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle

__all__ = ["GatheredColwise", "GatheredRegion", "ShardSequence", "LayersDone", "AfterLayers"]


def _gather(shard: torch.Tensor, mesh) -> torch.Tensor:
    """All-gather ``[B, S / tp, ...]`` shards along dim 1. Differentiable: the gradient of the
    gathered tensor is a partial sum on each rank (each holds only some output columns of the
    linears that read it), so it is reduce-scattered back to the shards."""
    return DTensor.from_local(shard, mesh, [Shard(1)], run_check=False).redistribute(
        mesh, [Replicate()]).to_local(grad_placements=[Partial()])


class _Regather:
    """The re-gathered input shared by the backward of ``users`` sibling linears."""

    def __init__(self, mesh, users: int):
        self.mesh, self.left, self.full = mesh, users, None

    def take(self, shard: torch.Tensor) -> torch.Tensor:
        full = self.full if self.full is not None else _gather(shard, self.mesh)
        self.left -= 1
        self.full = full if self.left > 0 else None
        return full


class _ColumnFromGathered(torch.autograd.Function):
    """``F.linear(x_full, w, b)`` that saves the sequence shard of ``x_full``, not ``x_full``."""

    @staticmethod
    def forward(ctx, x_full, x_shard, regather, weight, bias):
        out = F.linear(x_full, weight, bias)  # under autocast: in its dtype, like nn.Linear
        ctx.regather, ctx.has_bias = regather, bias is not None
        # backward computes in the forward's dtype (autocast is off in backward; autograd casts
        # the returned gradients to each input's dtype): keep the shard already in that dtype
        ctx.save_for_backward(x_shard.to(out.dtype), weight)
        return out

    @staticmethod
    def backward(ctx, grad):
        x_shard, weight = ctx.saved_tensors
        x_full = ctx.regather.take(x_shard.detach())
        weight = weight.to(grad.dtype)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        grad_w = g2.t().matmul(x_full.reshape(-1, x_full.shape[-1])) if ctx.needs_input_grad[3] else None
        grad_b = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[4] else None
        return grad_x, None, None, grad_w, grad_b


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _linear_forward(owner: nn.Module, output_placement):
    """The forward that replaces a column-parallel linear's: reads the owner's gathered input."""

    def forward(self, x):
        got = getattr(owner, "_ray_dhp_gathered", None)
        if got is None or x is not got[0]:
            raise RuntimeError(f"{type(owner).__name__}: a sequence-gathered column-parallel linear "
                               "got an input other than its owner's gathered sequence (the model's "
                               "forward transforms it first; this layout is not covered)")
        bias = _local(self.bias) if self.bias is not None else None
        out = _ColumnFromGathered.apply(x, got[1], got[2], _local(self.weight), bias)
        if output_placement is None:
            return out
        return DTensor.from_local(out, self.weight.device_mesh, [output_placement], run_check=False)

    return forward


class GatheredColwise(ParallelStyle):
    """Column-parallel ``linears`` (child paths of the styled module; ``""`` = the module itself,
    an ``nn.Linear``) whose common input, the module's first positional argument or keyword
    ``input_kwarg``, arrives sharded along the sequence (dim 1) over the TP mesh. Outputs are
    local ``[B, S, out / tp]`` tensors, or DTensors with ``output_placement`` (``lm_head`` keeps
    ``Shard(-1)`` logits for ``loss_parallel``)."""

    def __init__(self, linears: tuple, input_kwarg: Optional[str] = None, output_placement=None):
        super().__init__()
        self.linears, self.input_kwarg, self.output_placement = tuple(linears), input_kwarg, output_placement

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        for path in self.linears:
            lin = module.get_submodule(path)
            if not isinstance(lin, nn.Linear):
                raise ValueError(f"GatheredColwise: {path or type(module).__name__} is not an nn.Linear")
            for name, p in list(lin.named_parameters(recurse=False)):
                dp = distribute_tensor(p, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
                lin.register_parameter(name, nn.Parameter(dp, requires_grad=p.requires_grad))
            lin.forward = types.MethodType(_linear_forward(module, self.output_placement), lin)
        module.register_forward_pre_hook(self._pre_hook(device_mesh), with_kwargs=True)
        module.register_forward_hook(_clear, always_call=True)
        return module

    def _pre_hook(self, mesh):
        users, key = len(self.linears), self.input_kwarg

        def hook(module, args, kwargs):
            use_kw = key is not None and key in kwargs
            shard = _local(kwargs[key] if use_kw else args[0])
            full = _gather(shard, mesh)
            module._ray_dhp_gathered = (full, shard, _Regather(mesh, users))
            if use_kw:
                return args, {**kwargs, key: full}
            return (full, *args[1:]), kwargs

        return hook


def _clear(module, *_):
    module._ray_dhp_gathered = None


class ShardSequence(ParallelStyle):
    """The module's first positional input (or keyword ``input_kwarg``), whole on every TP rank,
    continues as this rank's sequence slice (dim 1), a fresh tensor: the whole input's storage is
    not kept alive by the slice (activation checkpointing keeps the block input). Backward
    all-gathers the gradient. ``marker`` (a `LayersDone`) is told the sequence is now sharded."""

    def __init__(self, input_kwarg: Optional[str] = None, marker=None):
        super().__init__()
        self.input_kwarg, self.marker = input_kwarg, marker

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        key, marker = self.input_kwarg, self.marker

        def hook(_module, args, kwargs):
            use_kw = key is not None and key in kwargs
            full = DTensor.from_local(_local(kwargs[key] if use_kw else args[0]), device_mesh,
                                      [Replicate()], run_check=False)
            shard = full.redistribute(device_mesh, [Shard(1)]).to_local().clone()
            if marker is not None:
                marker.sharded = True
            return (args, {**kwargs, key: shard}) if use_kw else ((shard, *args[1:]), kwargs)

        module.register_forward_pre_hook(hook, with_kwargs=True)
        return module


class GatheredRegion(ParallelStyle):
    """A module that runs on the whole sequence under Megatron sequence parallelism: its
    sequence-sharded input (first positional, or keyword ``input_kwarg``) is all-gathered along
    dim 1 before its forward. The styles inside (DTensor's ``ColwiseParallel`` et al.) make each
    rank's gradient of that input whole already (as under plain TP), so backward keeps this
    rank's slice of it (no communication). Its output is either sharded by its own row-parallel
    linear (``RowwiseParallel(output_layouts=Shard(1))``) or, ``shard_output``, whole on every
    rank (a sparse block's: replicated experts + an all-reduced shared expert) and then sliced to
    this rank's tokens (backward all-gathers); an output ``[tokens, d]`` of a ``[b, s, d]`` input
    (a block that returns its tokens flattened to ``[b s, d]``) is sliced as ``[b, s, d]``."""

    def __init__(self, input_kwarg: Optional[str] = None, shard_output: bool = False):
        super().__init__()
        self.input_kwarg, self.shard_output = input_kwarg, shard_output

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        key = self.input_kwarg
        shapes: list = []  # the gathered input's shape, to undo a block's flattening of tokens

        def pre(_module, args, kwargs):
            use_kw = key is not None and key in kwargs
            shard = _local(kwargs[key] if use_kw else args[0])
            full = DTensor.from_local(shard, device_mesh, [Shard(1)], run_check=False).redistribute(
                device_mesh, [Replicate()]).to_local()
            shapes[:] = [full.shape]
            return (args, {**kwargs, key: full}) if use_kw else ((full, *args[1:]), kwargs)

        def post(_module, _args, out):
            first = out[0] if isinstance(out, tuple) else out
            if first.dim() == 2 and len(shapes[0]) == 3:  # tokens flattened (a sparse block's)
                first = first.view(*shapes[0][:2], first.shape[-1])
            first = DTensor.from_local(_local(first), device_mesh, [Replicate()], run_check=False
                                       ).redistribute(device_mesh, [Shard(1)]).to_local()
            return (first, *out[1:]) if isinstance(out, tuple) else first

        module.register_forward_pre_hook(pre, with_kwargs=True)
        if self.shard_output:
            module.register_forward_hook(post)
        return module


class LayersDone:
    """Shared by `ShardSequence` (sets ``sharded``) and `AfterLayers` (checks it)."""
    sharded = False


class AfterLayers(ParallelStyle):
    """DTensor's ``SequenceParallel(use_local_output=True)`` (a per-token norm on this rank's
    tokens, its weight replicated, its gradient summed over the TP ranks) for a module the model
    must call *after* the sharded decoder layers (a final norm): it raises if called while the
    sequence is whole (``marker``, a `LayersDone`, not set), which would sum its weight's gradient
    over ranks that each saw every token."""

    def __init__(self, marker: LayersDone):
        super().__init__()
        self.marker = marker

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        from torch.distributed.tensor.parallel import SequenceParallel

        marker = self.marker

        def check(m, _args):
            if not marker.sharded:
                raise RuntimeError(f"{type(m).__name__} runs before the sequence-sharded decoder "
                                   "layers: text sequence parallelism does not cover this model")

        def done(*_):
            marker.sharded = False

        module.register_forward_pre_hook(check)
        SequenceParallel(use_local_output=True)._apply(module, device_mesh)
        module.register_forward_hook(done)
        return module
