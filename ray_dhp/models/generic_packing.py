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
  looked up at the *packed positions*, i.e. at another sample's tokens (Gemma 3: measured 0.79 of
  a row's largest logit). Such a model (``token_type_ids`` in its forward and
  ``sliding_attention`` layers) gets ``packed_masks``: each sample's masks built alone by its
  class's own static ``create_masks_for_generate`` and placed block-diagonally
  (`ray_dhp.models.packed_masks`); without one it is refused. Exactness is measured in fp64
  (tests/distributed/test_packing.py). Without a varlen kernel the packed rows' attention runs
  one sample at a time (`ray_dhp.models.segment_attention`) unless the forward takes
  ``token_type_ids`` (``segment_attention=False``: the block mask stays) or the layers have
  windows.
* **No state across samples** besides attention: a language model whose config lists
  ``layer_types`` that are not softmax attention (a short convolution, ``"conv"``; a linear
  attention, ``"linear_attention"``: a Gated DeltaNet's conv window and recurrent state) carries
  state along the sequence; its ``stateful_mixers`` are read from the decoder layers of those types (the
  one child holding a ``layer_idx``, as transformers' cache-holding mixers do, and its one
  ``nn.Linear`` child back to the hidden width) and run one row per sample from a zero state
  (`ray_dhp.models.segments`). Where the module tree does not name one of each, packing is
  refused, naming the types.
"""

from __future__ import annotations

import inspect

import torch

#: ``get_rope_index``'s leading parameters as `ray_dhp.data.collate` calls it
_ROPE_INDEX_PARAMS = ("input_ids", "mm_token_type_ids", "image_grid_thw", "video_grid_thw")


def packing_rule(inner, lm, text_config, forward_params: tuple, model_cls=None) -> dict:
    """The `FamilySpec` fields ``packing``, ``packing_reason``, ``packed_positions``,
    ``segment_attention`` and ``stateful_mixers``, and the `GenericFamily` field
    ``packed_masks``, for a model of class ``model_cls`` whose ``model.model`` is ``inner``,
    whose language model (decoder, on the meta device) is ``lm`` and whose stock forward names
    ``forward_params`` (module docstring)."""
    positions = "mrope" if hasattr(type(inner), "get_rope_index") else "1d"
    # per-sample attention: causal inside a sample (no bidirectional image blocks) and a forward
    # whose **kwargs carry the segments down to attention
    causal = "token_type_ids" not in forward_params and "kwargs" in forward_params
    mixers, why_not = stateful_mixers(lm, text_config)
    masks = _remapped_inputs(text_config, forward_params)
    refusal = _refusal(inner, lm, forward_params) or why_not
    if not refusal and masks and not _own_mask_mapping(model_cls):
        refusal = ("its sliding-window layers attend bidirectionally inside an image through a "
                   "mask rule that transformers evaluates at the packed positions instead of the "
                   "row's indices, and its class has no static create_masks_for_generate to "
                   "build each sample's masks with")
    rule = dict(packing=not refusal, packed_positions=positions, segment_attention=causal,
                stateful_mixers=mixers, packed_masks=bool(masks) and not refusal)
    return {**rule, "packing_reason": refusal} if refusal else rule


def stateful_mixers(lm, text_config) -> tuple:
    """``(mixers, refusal)``: `FamilySpec.stateful_mixers` of the decoder ``lm`` — for every
    layer whose ``layer_types`` entry is not softmax attention (`_stateful_type`), its
    token-mixing child (the one child that holds a ``layer_idx``, as transformers' cache-holding
    mixers do) and that child's output projection (its one ``nn.Linear`` child back to the
    hidden width) — or ``((), why)`` where the module tree does not say."""
    types = list(getattr(text_config, "layer_types", None) or ())
    other = [i for i, t in enumerate(types) if _stateful_type(t)]
    if not other:
        return (), ""
    stateful = ", ".join(map(repr, sorted({str(types[i]) for i in other})))
    if len(getattr(lm, "layers", ())) != len(types):  # a shrunk probe: the decoder at full depth
        from ray_dhp.models.generic_moe import _meta_lm

        lm = _meta_lm(type(lm), text_config.to_json_string(use_diff=False))
    layers = getattr(lm, "layers", None)
    if layers is None or len(layers) != len(types):
        return (), (f"its language model has {stateful} layers, which would carry state across "
                    "packed samples, and no decoder layers to find their mixers in")
    hidden = getattr(text_config, "hidden_size", None)
    out = []
    for i in other:
        mixers = [(n, m) for n, m in layers[i].named_children() if hasattr(m, "layer_idx")]
        projections = [] if len(mixers) != 1 else [
            n for n, m in mixers[0][1].named_children()
            if isinstance(m, torch.nn.Linear) and m.out_features == hidden]
        if len(projections) != 1:
            return (), (f"its language model has {stateful} layers, which would carry state "
                        f"across packed samples, and layer {i}'s mixer and output projection are "
                        f"not one each (mixers {[n for n, _ in mixers]}, projections {projections})")
        out.append((f"layers.{i}.{mixers[0][0]}", projections[0]))
    return tuple(out), ""


def _stateful_type(layer_type) -> bool:
    """Whether a ``layer_types`` entry names a layer that carries state along the sequence: any
    but softmax attention (``full_attention``, ``sliding_attention``, ``chunked_attention``, ...);
    a linear attention (``linear_attention``) is a recurrence (its state runs on into the next
    packed sample: measured 0.12 of a row's largest logit, tests/unit/test_packing.py)."""
    t = str(layer_type)
    return not t.endswith("attention") or t.startswith("linear")


def _remapped_inputs(text_config, forward_params: tuple) -> bool:
    """Whether the masks read per-token inputs besides the positions on layers whose rule
    transformers evaluates at packed positions: ``token_type_ids`` with sliding-window layers."""
    layer_types = set(getattr(text_config, "layer_types", None) or ())
    return "token_type_ids" in forward_params and "sliding_attention" in layer_types


def _own_mask_mapping(model_cls) -> bool:
    """Whether ``model_cls`` builds its forward's mask mapping itself (a static
    ``create_masks_for_generate``, what `ray_dhp.models.packed_masks` calls per sample)."""
    return model_cls is not None and isinstance(
        inspect.getattr_static(model_cls, "create_masks_for_generate", None), staticmethod)


def _refusal(inner, lm, forward_params: tuple) -> str:
    if "position_ids" not in inspect.signature(type(lm).forward).parameters:
        return "its language model's forward takes no position_ids, which packed rows restart"
    rope_index = getattr(type(inner), "get_rope_index", None)
    if rope_index is not None:
        params = tuple(inspect.signature(rope_index).parameters)[1:len(_ROPE_INDEX_PARAMS) + 1]
        if params != _ROPE_INDEX_PARAMS:
            return (f"its get_rope_index takes {params}, not the {_ROPE_INDEX_PARAMS} packing "
                    "computes each sample's positions with")
    return ""
