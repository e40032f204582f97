"""Experts sharded by tensor parallelism: every TP rank holds every expert's ``1/tp`` slice of
the intermediate dimension, as a dense MLP is sharded (transformers' ``base_model_tp_plan`` for
the MoE families: ``packed_colwise`` ``gate_up_proj``, ``rowwise`` ``down_proj``,
``moe_tp_experts``). The alternative to expert parallelism (`ray_dhp.parallel.expert`) for the
TP ranks of one replica, which hold the same tokens: the router and the routing stay replicated,
each rank runs all of its tokens' assignments through its slices, and one all-reduce sums the
partial outputs.

Storage: ``down_proj [E, H, I]`` is ``Shard(2)`` (contiguous columns ``[r I/tp, (r+1) I/tp)``).
``gate_up_proj [E, 2I, H]`` fuses two *kinds* of rows, ``[gate (I) | up (I)]``; the rank needs
its piece of each (``packed_colwise``), which is not one contiguous block, and the checkpoint,
loader and export keep parameters as contiguous shards (DCP chunks, safetensors slices). So it
is stored ``Shard(1)`` (contiguous rows ``[r 2I/tp, (r+1) 2I/tp)``) and, as for the fused
linear-attention projection (`ray_dhp.parallel.channels`), the rank's rows' outputs are
all-gathered along the channels and it keeps its gate and up pieces (forward all-gather of the
``[T k, 2I/tp]`` activations, backward reduce-scatter). Per sparse layer and forward:

1. ``hidden_states`` and ``top_k_weights`` enter through an identity whose backward all-reduces
   over TP (each rank's gradient w.r.t. them is the partial sum over its slice);
2. the assignments, sorted by expert, pass ``gate_up_proj``'s local rows (a loop over the
   experts: the CPU path; fp64 too), the all-gather + keep above, ``act(gate) * up`` on the
   rank's ``I/tp`` columns, ``down_proj``'s local columns: a partial ``[T k, H]``;
3. scaled by the routing weights and summed into the tokens (``index_add_``), then all-reduced
   over TP (backward: identity), which is the stock transformers experts module's output (the
   fused ``gate_up_proj`` layout).

Every TP rank runs the same collectives in the same order (two all-reduces and one all-gather
per sparse layer forward, their adjoints in backward): valid under NCCL. The experts' gradients
are whole for the rank's slices (the output gradient is replicated), reduced over the text
data-parallel replicas like any TP-sharded weight.
"""

from __future__ import annotations

import types
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.channels import _segment_pieces, segment_index
from ray_dhp.parallel.comm import CommCounter, record
from ray_dhp.parallel.text_sp import CopyToTP

__all__ = ["shard_experts_tp", "validate"]


def validate(family, config, tp: int) -> None:
    """Raise ValueError naming ``text.expert_tensor_parallel`` if the model cannot take it."""
    if family.moe is None:
        raise ValueError(f"text.expert_tensor_parallel=true: the {family.name} family is a dense "
                         "model (no experts); set it false.")
    if family.moe.ep_refusal:
        raise ValueError(f"text.expert_tensor_parallel=true is not covered for {family.name!r}: "
                         f"{family.moe.ep_refusal}; set it false.")
    i = config.text_config.moe_intermediate_size  # a list: one width per group of experts
    if any(w % tp for w in (i if isinstance(i, (list, tuple)) else (i,))):
        raise ValueError(f"text.expert_tensor_parallel=true: the experts' intermediate size ({i}) "
                         f"is not divisible by text.tensor_parallel={tp}.")


def shard_experts_tp(model: torch.nn.Module, spec, tp_mesh, comm: Optional[CommCounter] = None) -> None:
    """On the meta model: every experts module's ``gate_up_proj`` ``Shard(1)`` and ``down_proj``
    ``Shard(2)`` DTensors over ``tp_mesh`` (materialised later with their slice), and the
    TP-sharded forward (module docstring)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from ray_dhp.parallel.expert import expert_modules

    tp = tp_mesh.size()
    for m in expert_modules(model, spec):
        if m.intermediate_dim % tp:
            raise ValueError(f"text.expert_tensor_parallel: the experts' intermediate size "
                             f"({m.intermediate_dim}) is not divisible by text.tensor_parallel={tp}")
        for name, dim in (("gate_up_proj", 1), ("down_proj", 2)):
            p = m._parameters[name]
            d = distribute_tensor(p.detach(), tp_mesh, [Shard(dim)])
            m._parameters[name] = torch.nn.Parameter(d, requires_grad=p.requires_grad)
        i = m.intermediate_dim
        m.tp_mesh, m.tp_comm = tp_mesh, comm
        m.tp_keep = segment_index((i, i), tp, tp_mesh.get_local_rank())
        m.forward = types.MethodType(_tp_forward, m)


class _ReduceOut(torch.autograd.Function):
    """All-reduce (SUM) forward over the TP group; identity backward."""

    @staticmethod
    def forward(ctx, x, group, comm):
        x = x.contiguous().clone()
        record(comm, "all_reduce", "text.experts_tp", x)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


def _tp_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
    """The stock experts' ``forward`` with this rank's intermediate slices (module docstring)."""
    mesh, comm = self.tp_mesh, self.tp_comm
    group = mesh.get_group()
    x = CopyToTP.apply(hidden_states, group, comm, "text.experts_tp.grad")
    w = CopyToTP.apply(top_k_weights, group, comm, "text.experts_tp.grad")
    gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
    top_k = top_k_index.shape[1]
    flat_expert = top_k_index.reshape(-1)
    order = torch.argsort(flat_expert, stable=True)
    token = order // top_k
    counts = torch.bincount(flat_expert, minlength=self.num_experts).tolist()
    rows = x[token].split(counts)
    h = torch.cat([torch.nn.functional.linear(r, gate_up[e]) for e, r in enumerate(rows)])
    record(comm, "all_gather", "text.experts_tp", h)
    if h.requires_grad and comm is not None:  # its adjoint: a reduce-scatter of [T k, 2I]
        h.register_hook(lambda g: record(comm, "reduce_scatter", "text.experts_tp.grad",
                                         g.numel() * g.element_size() * mesh.size()))
    gate, up = _segment_pieces(h, mesh, self.tp_keep).chunk(2, dim=-1)
    a = (self.act_fn(gate) * up).split(counts)
    y = torch.cat([torch.nn.functional.linear(r, down[e]) for e, r in enumerate(a)])
    out = torch.zeros_like(hidden_states)
    out = out.index_add(0, token, (y * w.reshape(-1)[order][:, None]).to(out.dtype))
    return _ReduceOut.apply(out, group, comm)


def check_expert_tp(on, tp: int, ep: int, zero: int) -> None:
    """``text.expert_tensor_parallel``: a bool, with text TP > 1, without EP or ZeRO-3."""
    if not isinstance(on, bool):
        raise ValueError(f"text.expert_tensor_parallel must be true or false, got {on!r}.")
    if not on:
        return
    if tp == 1:
        raise ValueError("text.expert_tensor_parallel=true shards the experts over the text "
                         "tensor-parallel ranks and needs text.tensor_parallel > 1.")
    if ep > 1:
        raise ValueError("text.expert_tensor_parallel=true and text.expert_parallel > 1 are "
                         "exclusive (experts either partitioned over replicas or sharded over TP); "
                         "set one of them off.")
    if zero == 3:
        raise ValueError("text.expert_tensor_parallel=true is not covered with text.zero_stage=3; "
                         "use text.zero_stage 0-2.")
