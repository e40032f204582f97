"""Ulysses sequence parallelism for a full-attention ViT on fixed tiles (InternVL's InternViT).

The transformers tower is used as it is: its sub-modules (the patch convolution, the CLS token,
the absolute position table, every ``InternVLVisionLayer``, the final norm) and the model's
``multi_modal_projector`` are driven here on the local tokens of one sequence-parallel (SP) rank;
each layer's attention gets the Ulysses forward below (two all-to-alls per layer).

What differs from the Qwen towers (`ray_dhp.models.vision_qwen`), and why the split is simple:

* **Inputs are patch rows.** A sample's ``pixel_values`` hold one row per patch,
  ``[tiles * h * w, C * P * P]`` in each tile's raster order, and its grid is ``(tiles, h, w)``
  (`ray_dhp.data.tiles`), the layout every data mechanism already handles; `stock_pixels`
  turns the rows back into the ``[tiles, C, S, S]`` images the stock model takes.
* **Order is free inside a tile.** Every layer is full attention over one tile, and positions
  enter only once, as an absolute table added after the patch embedding: attention over a tile
  is the same for any order of its tokens. So the processing order is chosen to suit the
  feature seam: per tile, its CLS token, then the pixel-shuffle units (2x2 patches for
  ``downsample_ratio`` 0.5) in the order of the projected rows, each unit's patches in the
  order pixel shuffle concatenates their channels. A rank's rows are then its own units: the
  final norm, the CLS drop, pixel shuffle (a reshape) and the projector run on local tokens.
* **One attention segment per tile** (``cu_seqlens``: ``1 + h*w`` tokens each); SP ranks are cut
  on unit boundaries, token-balanced; a tile's CLS token goes with its first unit.

Example::

    plan = plan_for("internvl", model.config, grid_thw, sp=2)
    feats = vision_forward("internvl", parts, pixel_rows, plan, sp_rank, sp_group)
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from typing import Optional

import torch

from ray_dhp.models.vision_qwen import VisionShardPlan, _balanced_cuts, _nonempty, _ulysses_context
from ray_dhp.parallel.comm import CommCounter
from ray_dhp.parallel.ulysses import UlyssesContext, _segment_attention, heads_to_seq, seq_to_heads

__all__ = ["TilePlan", "plan_for", "vision_forward", "install_for", "stock_pixels", "merge_size"]


def merge_size(config) -> int:
    """Patches per side of one projected row: ``1 / downsample_ratio`` (2 for InternVL's 0.5)."""
    m = round(1 / config.downsample_ratio)
    if abs(m * config.downsample_ratio - 1) > 1e-9:
        raise ValueError(f"downsample_ratio={config.downsample_ratio}: only 1/n ratios are covered")
    return m


@dataclass
class TilePlan(VisionShardPlan):
    """A `VisionShardPlan` over tiles: ``order`` is the natural row order (rows of tile ``t`` are
    ``t*R .. t*R+R-1`` for ``R = h*w / merge**2``); ``tokens`` holds, per rank, the local tokens
    as global token ids in processing order (``-1 - t``: tile ``t``'s CLS token, else a patch row
    of ``pixel_values`` in unit order); ``cu_seqlens`` counts ``1 + h*w`` tokens per tile."""

    tokens: Optional[list] = None

    def tokens_per_rank(self) -> list[int]:
        return [int(t.numel()) for t in self.tokens]


def _unit_patches(h: int, w: int, m: int) -> torch.Tensor:
    """``[h*w/m², m²]`` patch ids (raster in the tile) of each unit, units in pixel-shuffle output
    order (raster over the ``h/m x w/m`` grid), patches in its channel order (row-major in the
    unit: transformers' ``pixel_shuffle`` concatenates ``x[m*a + i, m*b + j]`` over ``i`` then ``j``)."""
    a = torch.arange(h // m)[:, None, None, None]
    b = torch.arange(w // m)[None, :, None, None]
    i = torch.arange(m)[None, None, :, None]
    j = torch.arange(m)[None, None, None, :]
    return ((m * a + i) * w + (m * b + j)).reshape(-1, m * m)


def plan_for(family: str, config, grid_thw: torch.LongTensor, sp: int) -> TilePlan:
    """Split one replica's tiles (``grid_thw`` rows ``(tiles, h, w)`` per image) over ``sp`` ranks;
    deterministic (same on every rank). ``config``: the model config."""
    vc = config.vision_config
    if vc.num_attention_heads % sp:
        raise ValueError(f"vision num_attention_heads={vc.num_attention_heads} is not divisible by "
                         f"the vision sequence-parallel degree sp={sp}.")
    m = merge_size(config)
    grid = torch.as_tensor(grid_thw, dtype=torch.long).cpu()
    tiles = [(int(h), int(w)) for t, h, w in grid.tolist() for _ in range(t)]
    unit_ids, unit_tile, tile_first, patch0 = [], [], [], 0
    for t, (h, w) in enumerate(tiles):
        units = _unit_patches(h, w, m) + patch0
        tile_first.append(len(unit_ids))
        unit_ids.extend(units)
        unit_tile.extend([t] * units.shape[0])
        patch0 += h * w
    n_rows, unit = len(unit_ids), m * m
    starts = set(tile_first)
    bounds, tok = [0], 0  # token offset of every row boundary (a CLS counts with its tile's first row)
    for r in range(n_rows):
        tok += unit + (r in starts)
        bounds.append(tok)
    tcuts = _balanced_cuts(bounds, sp)
    cuts = [bounds.index(c) for c in tcuts]
    tokens = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        parts = []
        for r in range(lo, hi):
            if r in starts:
                parts.append(torch.tensor([-1 - unit_tile[r]]))
            parts.append(unit_ids[r])
        tokens.append(torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long))
    seg = torch.tensor([0] + [1 + h * w for h, w in tiles]).cumsum(0).to(torch.int32)
    return TilePlan(grid_thw=grid, order=torch.arange(n_rows), cuts=cuts, merge_unit=unit,
                    cu_seqlens=seg, tokens=tokens)


def _ulysses_tile_attention(self, hidden_states, attention_mask=None, ulysses=None,
                            cu_seqlens=None, **kwargs):
    """Forward of an ``InternVLVisionAttention`` on ``[1, S_local, D]`` local tokens: the local
    q/k/v projections and q/k norms (over the whole width, as the stock module), all-to-all to
    head sharding, attention per tile segment of the global ``cu_seqlens``, all-to-all back,
    the local output projection. Returns ``(output, None)`` like the stock module."""
    x = hidden_states[0]
    s, heads, hd = x.shape[0], self.num_heads, self.head_dim
    q = self.q_norm(self.q_proj(x)).reshape(s, heads, hd)
    k = self.k_norm(self.k_proj(x)).reshape(s, heads, hd)
    v = self.v_proj(x).reshape(s, heads, hd)
    if ulysses is not None and ulysses.sp > 1:
        q, k, v = seq_to_heads(torch.stack([q, k, v], dim=1), ulysses).unbind(1)
    self.scaling = self.scale  # the name `_segment_attention` reads
    out = _segment_attention(self, q, k, v, cu_seqlens)
    if ulysses is not None and ulysses.sp > 1:
        out = heads_to_seq(out, ulysses)
    return self.projection_dropout(self.projection_layer(out.reshape(1, s, heads * hd))), None


def install_for(family: str, visual: torch.nn.Module, sp: int = 1) -> None:
    """Install the tile attention on every layer's attention (idempotent; names unchanged)."""
    for layer in visual.vision_tower.encoder.layer:
        attn = layer.attention
        if attn.num_heads % sp:
            raise ValueError(f"vision num_attention_heads={attn.num_heads} is not divisible by the "
                             f"vision sequence-parallel degree sp={sp}.")
        if not getattr(attn, "_ray_dhp_ulysses", False):
            attn.forward = types.MethodType(_ulysses_tile_attention, attn)
            attn._ray_dhp_ulysses = True


def _embed(tower, pixel_rows: torch.Tensor, tokens: torch.Tensor, patch_size) -> torch.Tensor:
    """Local token embeddings ``[S_local, D]``: the patch convolution on each local patch row
    (a ``P x P`` image: the stride-``P`` convolution sees exactly that patch), the CLS token for
    the tiles whose CLS is local, plus each token's absolute position (CLS: row 0)."""
    emb = tower.embeddings
    conv = emb.patch_embeddings.projection
    is_patch = tokens >= 0
    rows = tokens[is_patch]
    dev = pixel_rows.device
    px = pixel_rows[rows.to(dev)].reshape(-1, emb.patch_embeddings.num_channels, *patch_size)
    patches = _nonempty(lambda t: conv(t.to(conv.weight.dtype)).flatten(1), px, pad_rows=1)
    out = torch.zeros(tokens.numel(), conv.weight.shape[0], dtype=patches.dtype, device=patches.device)
    out = out.index_put((is_patch.nonzero().flatten().to(dev),), patches)
    n_cls = int((~is_patch).sum())
    if n_cls:
        out = out.index_put(((~is_patch).nonzero().flatten().to(dev),),
                            emb.cls_token.reshape(1, -1).expand(n_cls, -1))
    if emb.position_embeddings is not None:
        per_tile = emb.position_embeddings.shape[1] - 1
        pos = torch.where(is_patch, 1 + tokens % per_tile, torch.zeros_like(tokens))
        out = out + emb.position_embeddings[0, pos.to(dev)]
    return out


def vision_forward(family: str, visual: torch.nn.Module, pixel_values: torch.Tensor, plan: TilePlan,
                   sp_rank: int, sp_group, comm: Optional[CommCounter] = None) -> torch.Tensor:
    """SP rank ``sp_rank``'s projected rows ``[rows_local, D_llm]`` (rows ``plan.rows(sp_rank)``).

    ``visual``: the vision parts (``vision_tower``, ``multi_modal_projector``); ``pixel_values``:
    all patch rows of the replica's tiles."""
    install_for(family, visual)
    tower, config = visual.vision_tower, visual.vision_tower.config
    ctx = _ulysses_context(plan, sp_rank, sp_group, comm)
    tokens = plan.tokens[sp_rank]
    hidden = _embed(tower, pixel_values, tokens, tuple(config.patch_size))[None]
    for layer in tower.encoder.layer:
        hidden = _call_layer(layer, hidden, ctx, plan.cu_seqlens)
    hidden = tower.layernorm(hidden[0])
    hidden = hidden[(tokens >= 0).to(hidden.device)]  # the CLS tokens are not features
    feats = hidden.reshape(-1, plan.merge_unit * hidden.shape[-1])  # pixel shuffle: a reshape here
    return _nonempty(visual.multi_modal_projector, feats, pad_rows=1)


def _layer_body(layer, hidden, ctx: Optional[UlyssesContext], cu_seqlens):
    """``InternVLVisionLayer.forward`` driven on its sub-modules, with the Ulysses context
    handed to the attention (the stock layer calls ``self.attention(x)`` with no argument)."""
    attn, _ = layer.attention(layer.layernorm_before(hidden), ulysses=ctx, cu_seqlens=cu_seqlens)
    hidden = layer.lambda_1 * attn + hidden
    out = layer.dropout(layer.mlp(layer.layernorm_after(hidden)))
    if layer.lambda_2 is not None:
        out = layer.lambda_2 * out
    return out + hidden


def _call_layer(layer, hidden, ctx: Optional[UlyssesContext], cu_seqlens):
    """One layer; recomputed in backward when the model has gradient checkpointing on (the
    layer's ``gradient_checkpointing`` flag; non-reentrant, the context kept by the closure)."""
    if getattr(layer, "gradient_checkpointing", False) and layer.training and torch.is_grad_enabled():
        from torch.utils.checkpoint import checkpoint

        return checkpoint(_layer_body, layer, hidden, ctx, cu_seqlens, use_reentrant=False)
    return _layer_body(layer, hidden, ctx, cu_seqlens)


def stock_pixels(config, pixel_values: torch.Tensor, grid_thw: torch.LongTensor) -> torch.Tensor:
    """Patch rows ``[tiles*h*w, C*P*P]`` -> the stock model's ``[tiles, C, h*P, w*P]`` images."""
    p = tuple(config.vision_config.patch_size)
    c = config.vision_config.num_channels
    out = []
    for rows, (t, h, w) in zip(pixel_values.split(grid_thw.prod(-1).tolist()), grid_thw.tolist()):
        x = rows.reshape(t, h, w, c, p[0], p[1]).permute(0, 3, 1, 4, 2, 5)
        out.append(x.reshape(t, c, h * p[0], w * p[1]))
    return torch.cat(out)
