"""Vision activation bytes for `ray-dhp plan` (`ray_dhp.planning.memory` re-exports these).

The count is what autograd saves for backward inside a hand-written family's vision tower (each
storage once, parameters excluded), per patch token, as measured with
``torch.autograd.graph.saved_tensors_hooks`` on the stock transformers towers at their published
widths (``tests/unit/test_vision_memory.py`` compares it with the measured bytes;
``benchmarks/video_sp.py`` at 16 frames). ``d`` is the activation element size
(`ActivationSettings.dtype_bytes`), ``h`` the ViT width, ``i`` its MLP width. Per block and token:

* two norms. An RMSNorm tower's (`FamilySpec.vision_norm` ``"rms_norm"``) upcasts to fp32 and
  keeps the fp32 input, the fp32 ``rsqrt`` and the normalised input in the model's dtype:
  ``4h + 4 + d·h`` bytes each; the other towers' LayerNorm keeps its input and fp32 mean and
  rstd: ``d·h + 8``;
* attention (SDPA/flash): the qkv projection's input ``h`` and output ``3h``, the rotated q and k
  and the attention output (``3h``) in ``d`` bytes, plus the kernel's fp32 log-sum-exp (one per
  head); a tower that does not rotate q and k (`FamilySpec.vision_rotary` False: towers with
  learned absolute positions) keeps ``2h`` less and no rotary tables, one that rotates them but
  projects q, k and v apart (`FamilySpec.vision_fused_qkv` False) ``2h`` less (v alone, not the
  ``3h``). Under Ulysses (SP > 1, the full-attention blocks) ``6h``: the qkv input, the
  all-to-all's head-sharded q, k, v (``3h``), the attention output and the projection's input
  (the output all-to-all's result; measured on a rotary tower with a fused qkv, taken as the same
  for a tower without rotary);
* the MLP: its input ``h`` and ``m·i``, where ``m`` counts the ``i``-wide tensors its activation
  path keeps: a gated SiLU 4 (gate, SiLU output, up, product), QuickGELU 3 (fc1 output, sigmoid,
  product: ``x·sigmoid(1.702x)`` is three ops), a one-op GELU 2 (fc1 output, GELU output).

Once per token: the patch input of the Conv3d (``C·T·P²`` values), the rotary ``cos`` and
``sin`` (fp32, ``head_dim`` each, shared by every block), a learned position table's
interpolation indices (4 int64, a config with ``num_position_embeddings``), the merger (its norm,
then its two linears' inputs and the GELU's: ``3·d·h`` per token, the merged rows being
``merge²·h`` wide) and each deepstack merger (the same without re-keeping its norm input, the
block output the next block keeps already). Under Ulysses SP every term is ``1/sp`` of the
tokens, but for a tower that runs its once-per-token parts whole on every SP rank
(`ray_dhp.models.vision_once_split`: a generic family's, whose layers alone split) those. With ``attention="eager"`` the ``heads × s²`` score and probability
matrices are added; with activation checkpointing each block keeps only its input, plus one block
recomputed.

A generic family's tower (`ray_dhp.models.vision_saved_per_token`, given the model's config)
takes measured bytes for the formula's: what its own ``get_image_features`` saves on the meta
device per patch token, split into the encoder layers' (``1/sp`` of the tokens) and the rest
(whole on every SP rank); the formula's Ulysses buffers, eager scores and checkpointing (each
block keeps its input, one block recomputed: the measured layers' bytes over the depth) stay.
Where the meta call cannot run, the formula stands.
"""

from __future__ import annotations

from typing import Optional

from ray_dhp.models.sizes import vision_width

__all__ = ["vision_activation_bytes", "vision_activation_parts", "vision_block_weights"]

# ``i``-wide tensors an MLP keeps per token, by activation (the gated SiLU MLP counts its up
# branch); another activation counts as a one-op one (2)
_MLP_KEPT = {"silu": 4, "quick_gelu": 3, "gelu": 2, "gelu_pytorch_tanh": 2}


def _vision_mlp(vc) -> int:
    """The MLP width: ``intermediate_size`` (``mlp_dim``: SAM-style towers), else the width
    times ``mlp_ratio`` (towers that give their MLP width as a ratio)."""
    i = getattr(vc, "intermediate_size", None) or getattr(vc, "mlp_dim", None)
    return i if i else int(vision_width(vc) * getattr(vc, "mlp_ratio", 4))


def _heads(vc) -> int:
    return getattr(vc, "num_heads", None) or vc.num_attention_heads


def _rms_norm(vc) -> bool:
    """Whether the tower's norms are RMSNorms computing in fp32 (the family's
    `FamilySpec.vision_norm`); else LayerNorms."""
    from ray_dhp.models import vision_norm

    return vision_norm(vc) == "rms_norm"


def _rotary(vc) -> bool:
    """Whether the tower rotates q and k (`ray_dhp.models.vision_rotary`)."""
    from ray_dhp.models import vision_rotary

    return vision_rotary(vc)


def _attention_widths(vc) -> int:
    """``h``-wide tensors an attention block keeps per token off Ulysses (module docstring): its
    input and output, the rotated q and k, and the projections' outputs the kernel or the
    rotation does not replace (a fused qkv's ``3h``; apart, v alone when q and k are rotated)."""
    from ray_dhp.models import vision_fused_qkv

    rotary = _rotary(vc)
    return 2 + 2 * rotary + (3 if vision_fused_qkv(vc) or not rotary else 1)


def _norm_bytes(vc, h: int, d: int) -> int:
    return 4 * h + 4 + d * h if _rms_norm(vc) else d * h + 8


def _block_bytes(vc, h: int, i: int, d: int) -> float:
    """Bytes one block keeps per token (module docstring)."""
    attention = _attention_widths(vc) * d * h + 4 * _heads(vc)
    mlp = d * h + _MLP_KEPT.get(getattr(vc, "hidden_act", "quick_gelu"), 2) * d * i
    return 2 * _norm_bytes(vc, h, d) + attention + mlp


def vision_block_weights(vc) -> int:
    """Weights and biases one ViT block's matmuls take: q, k, v and the output projection
    (``4h² + 4h``) and the MLP (a gated one's three ``h × i`` matrices, else two); the norms'
    few ``h`` are left out (autocast does not cast them, `ray_dhp.planning.memory.weight_cast_bytes`)."""
    h, i = vision_width(vc), _vision_mlp(vc)
    gated = _MLP_KEPT.get(getattr(vc, "hidden_act", "quick_gelu"), 2) == 4
    return 4 * h * h + 4 * h + (3 * h * i + 2 * i + h if gated else 2 * h * i + i + h)


def _once_bytes(vc, h: int, d: int) -> float:
    """Bytes per token kept once per tower: patches, rotary tables, position indices, mergers."""
    channels = getattr(vc, "in_channels", None) or getattr(vc, "in_chans", 3)
    patches = channels * getattr(vc, "temporal_patch_size", 1) * _patch_side(vc) ** 2 * d
    rotary = 2 * (h // _heads(vc)) * 4 if _rotary(vc) else 0
    positions = 4 * 8 if getattr(vc, "num_position_embeddings", None) else 0
    merger = _norm_bytes(vc, h, d) + 3 * d * h
    n_deep = len(getattr(vc, "deepstack_visual_indexes", None) or ())
    deepstack = n_deep * (3 * d * h + 8 / vc.spatial_merge_size ** 2) if n_deep else 0
    return patches + rotary + positions + merger + deepstack


def _once_split(vc) -> bool:
    """Whether the once-per-token parts are split over SP ranks (`ray_dhp.models.vision_once_split`)."""
    from ray_dhp.models import vision_once_split

    return vision_once_split(vc)


def _probed(config, d: int):
    """`ray_dhp.models.vision_saved_per_token` of ``config`` at ``d`` bytes, or None."""
    from ray_dhp.models import vision_saved_per_token

    return vision_saved_per_token(config, d)


def _depth(vc) -> int:
    """ViT blocks: ``depth`` (towers that count blocks as ``depth``), else ``num_hidden_layers``."""
    return getattr(vc, "depth", None) or vc.num_hidden_layers


def _patch_side(vc) -> int:
    """Patch side in pixels (InternViT's config gives ``(h, w)``: square patches)."""
    p = vc.patch_size
    return p[0] if isinstance(p, (tuple, list)) else p


def _ulysses_blocks(vc, sp: int) -> int:
    """Blocks whose attention runs the Ulysses all-to-alls: the full-attention ones at SP > 1."""
    if sp == 1:
        return 0
    full = getattr(vc, "fullatt_block_indexes", None)
    return _depth(vc) if full is None else len(full)


def vision_activation_bytes(vc, tokens: int, sp: int, s,
                            image_tokens: Optional[int] = None, config=None) -> float:
    """Activation bytes of one vision SP rank for ``tokens`` patch tokens of its replica
    (``s``: an `ActivationSettings`): saved plus transient (`vision_activation_parts`)."""
    return sum(vision_activation_parts(vc, tokens, sp, s, image_tokens, config))


def vision_activation_parts(vc, tokens: int, sp: int, s,
                            image_tokens: Optional[int] = None, config=None) -> tuple:
    """``(saved, transient)`` bytes of one vision SP rank: what the forward saves for backward
    and, with activation checkpointing, the one block recomputed at a time in backward.
    ``config`` (the model's, optional): where `ray_dhp.models.vision_saved_per_token` measures
    its tower (a generic family's), the measured bytes stand for the block formula."""
    h, i, depth, d = vision_width(vc), _vision_mlp(vc), _depth(vc), s.dtype_bytes
    local = tokens / sp
    probed = _probed(config, d) if config is not None else None
    if probed is None:
        per_block, once = local * _block_bytes(vc, h, i, d), _once_bytes(vc, h, d)
    else:  # measured from the model's own code: all layers' bytes per token, then the rest
        per_block, once = local * probed[0] / depth, probed[1]
    if s.checkpointing:
        blocks, transient = depth * local * h * d, per_block
    else:
        ulysses = _ulysses_blocks(vc, sp) * (6 - _attention_widths(vc)) * local * h * d
        blocks, transient = depth * per_block + ulysses, 0.0
    total = blocks + (local if _once_split(vc) else tokens) * once
    if s.attention == "eager":
        seg = image_tokens or tokens
        full = len(getattr(vc, "fullatt_block_indexes", None) or range(depth))
        window = (getattr(vc, "window_size", 0) // _patch_side(vc)) ** 2 or seg
        windows = depth - full
        heads = _heads(vc) / sp
        scores = 2 * heads * (tokens / seg) * seg * seg * s.dtype_bytes
        if s.checkpointing:
            transient += scores
        else:
            total += scores * full + 2 * heads * tokens * min(window, seg) * s.dtype_bytes * windows
    return total, transient
