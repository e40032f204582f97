"""A Megatron-style tensor-parallel plan for the Qwen2.5-VL ViT (the uniform-TP baseline).

The plan is data (module path -> ParallelStyle), applied with ``parallelize_module`` like the
library's text plan. Two things the plain styles cannot know are fixed up by `prepare_vit_for_tp`
before the plan is applied:

* the fused ``attn.qkv`` Linear packs ``[q; k; v]`` (each ``H * hd`` rows). A plain
  ``ColwiseParallel`` would hand rank 0 all of q and part of k. So the rows are permuted once into
  per-rank blocks ``[q_0; k_0; v_0; q_1; k_1; v_1; ...]`` (``q_r`` = heads ``r*H/tp .. (r+1)*H/tp``),
  after which the column shard of rank r is exactly ``[q_r; k_r; v_r]``;
* each attention module then computes ``H / tp`` heads (``attn.num_heads``), which the stock
  forward uses in its ``reshape(seq, 3, num_heads, -1)``.

The sequence stays replicated on every rank (that is the point of this baseline): every rank
runs every patch through every block with a 1/tp slice of the heads and MLP width, and each
block does two all-reduces forward (after ``proj`` and ``down_proj``) and two backward.
"""

from __future__ import annotations

import torch


def vit_tp_plan(prefix: str = "model.visual") -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    blk = f"{prefix}.blocks.*"
    return {
        f"{blk}.attn.qkv": ColwiseParallel(),
        f"{blk}.attn.proj": RowwiseParallel(),
        f"{blk}.mlp.gate_proj": ColwiseParallel(),
        f"{blk}.mlp.up_proj": ColwiseParallel(),
        f"{blk}.mlp.down_proj": RowwiseParallel(),
        f"{prefix}.merger.mlp.0": ColwiseParallel(),
        f"{prefix}.merger.mlp.2": RowwiseParallel(),
    }


def qkv_row_permutation(num_heads: int, head_dim: int, tp: int) -> torch.LongTensor:
    """Row order taking ``[q; k; v]`` to ``[q_0; k_0; v_0; ...; q_{tp-1}; k_{tp-1}; v_{tp-1}]``."""
    if num_heads % tp:
        raise ValueError(f"vision num_heads={num_heads} is not divisible by tp={tp}")
    dim, per = num_heads * head_dim, (num_heads // tp) * head_dim
    return torch.cat([torch.arange(which * dim + r * per, which * dim + (r + 1) * per)
                      for r in range(tp) for which in range(3)])


@torch.no_grad()
def prepare_vit_for_tp(visual: torch.nn.Module, tp: int) -> None:
    """Permute every block's qkv rows into per-rank blocks and set the local head count."""
    for blk in visual.blocks:
        attn = blk.attn
        perm = qkv_row_permutation(attn.num_heads, attn.head_dim, tp)
        attn.qkv.weight.copy_(attn.qkv.weight[perm])
        attn.qkv.bias.copy_(attn.qkv.bias[perm])
        attn.num_heads //= tp


def parallelize_vit(model: torch.nn.Module, tp_mesh) -> None:
    """Apply the uniform-TP plan to ``model.model.visual`` over the 1-D ``tp_mesh``."""
    from ray_dhp.parallel.tensor import apply_tp_plan

    prepare_vit_for_tp(model.model.visual, tp_mesh.size())
    apply_tp_plan(model, tp_mesh, vit_tp_plan())
