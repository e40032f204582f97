"""Whether a generic family (`ray_dhp.models.generic`) packs samples into rows, read from the
model's own code and config, and with which positions.

A packed row computes what its samples compute alone when (see `ray_dhp.data.collate.
pack_text_batch`, which passes ``position_ids`` and no 2-D ``attention_mask``):

* **Positions** restart at each sample, as the model's own rule gives them. A model whose
  ``model.model`` defines ``get_rope_index(input_ids, mm_token_type_ids, image_grid_thw,
  video_grid_thw, ...)`` (Qwen-VL's signature; GLM-4V's M-RoPE) takes each sample's M-RoPE
  positions from it (``packed_positions="mrope"``: ``[4, R, L]``, row 0 the text positions its
  language model builds the mask from); a ``get_rope_index`` of another signature is refused.
  Without one, the language model's positions are 1-D (``"1d"``: ``[R, L]``, 0..n-1 per sample).
  The language model's forward must take ``position_ids``.
* **Attention** stays inside a sample: transformers' mask builders (``masking_utils``) detect the
  packed samples from the restarting positions (``find_packed_sequence_indices``), evaluate the
  mask rule at the packed positions (a sliding window's distances are then per sample) and AND
  the block-diagonal mask onto it. A forward that takes ``token_type_ids`` attends bidirectionally
  inside an image: as ``block_sequence_ids`` (looked up at row indices, exact: PaliGemma) on full
  attention; but a sliding-window layer gets those blocks as an ``or_mask_function``, which is
  looked up at the *packed positions*, i.e. at another sample's tokens (Gemma 3: measured
  packed != one per row, loss 1e-4 relative). Such a model (``token_type_ids`` in its forward
  and ``sliding_attention`` layers) is refused. Exactness is measured in fp64
  (tests/distributed/test_packing.py). Without a varlen kernel the packed rows' attention runs
  one sample at a time (`ray_dhp.models.segment_attention`) unless the forward takes
  ``token_type_ids`` (``segment_attention=False``: the block mask stays) or the layers have
  windows.
* **No state along the sequence** besides attention: a language model whose config lists
  ``layer_types`` that are not attention (e.g. a short convolution, ``"conv"``) would carry it
  across the samples of a row, so packing is refused for it, naming the types.
"""

from __future__ import annotations

import inspect

#: ``get_rope_index``'s leading parameters as `ray_dhp.data.collate` calls it
_ROPE_INDEX_PARAMS = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw")


def packing_rule(inner, lm, text_config, forward_params: tuple) -> dict:
    """The `FamilySpec` fields ``packing``, ``packing_reason`` and ``packed_positions`` for a
    model whose ``model.model`` is ``inner``, whose language model is ``lm`` and whose stock
    forward names ``forward_params`` (module docstring)."""
    refusal = _refusal(inner, lm, text_config, forward_params)
    positions = "mrope" if hasattr(type(inner), "get_rope_index") else "1d"
    # per-sample attention: causal inside a sample (no bidirectional image blocks) and a forward
    # whose **kwargs carry the segments down to attention
    causal = "token_type_ids" not in forward_params and "kwargs" in forward_params
    if refusal:
        return dict(packing=False, packing_reason=refusal, packed_positions=positions,
                    segment_attention=causal)
    return dict(packing=True, packed_positions=positions, segment_attention=causal)


def _refusal(inner, lm, text_config, forward_params: tuple) -> str:
    if "position_ids" not in inspect.signature(type(lm).forward).parameters:
        return "its language model's forward takes no position_ids, which packed rows restart"
    rope_index = getattr(type(inner), "get_rope_index", None)
    if rope_index is not None:
        params = tuple(inspect.signature(rope_index).parameters)[1:len(_ROPE_INDEX_PARAMS) + 1]
        if params != _ROPE_INDEX_PARAMS:
            return (f"its get_rope_index takes {params}, not the {_ROPE_INDEX_PARAMS} packing "
                    "computes each sample's positions with")
    stateful = sorted({t for t in getattr(text_config, "layer_types", None) or ()
                       if not str(t).endswith("attention")})
    if stateful:
        return (f"its language model has {', '.join(map(repr, stateful))} layers, which would "
                "carry state across packed samples")
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    if "token_type_ids" in forward_params and "sliding_attention" in layer_types:
        return ("its sliding-window layers attend bidirectionally inside an image through a "
                "mask rule that transformers evaluates at the packed positions instead of the "
                "row's indices, so packed samples would see other image blocks than alone")
    return ""
