"""Whether a generic family (`ray_dhp.models.generic`) packs samples into rows, read from the
model's own code and config, and with which positions.

A packed row computes what its samples compute alone when (see `ray_dhp.data.collate.
pack_text_batch`, which passes ``position_ids`` and no 2-D ``attention_mask``):

* **Positions** restart at each sample, as the model's own rule gives them. A model whose
  ``model.model`` defines ``get_rope_index`` takes each sample's M-RoPE positions from it
  (``packed_positions="mrope"``: ``[4, R, L]``, row 0 the text positions its language model
  builds the mask from), called on the sample alone with the arguments its signature names
  (`packed_rope_index`): ``input_ids``, ``mm_token_type_ids`` and the images' grids under the
  name the stock forward hands them on (``image_grid_thw``: Qwen-VL's signature, GLM-4V's;
  ``target_sizes``, `ray_dhp.models.generic_probe.packed_grid`: MiniCPM-V 4.7's canvas M-RoPE),
  its other parameters at their defaults as in the stock forward's call (a padding
  ``attention_mask``: none for a sample alone; ``downsample_mode``: the config's, the mode the
  tower runs with). A ``get_rope_index`` that needs another argument, or takes no image grid
  under either name, is refused. Without one, the language model's positions are 1-D (``"1d"``:
  ``[R, L]``, 0..n-1 per sample). The language model's forward must take ``position_ids``.
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
  attention, ``"linear_attention"``: the types transformers' ``masking_utils`` builds a
  recurrent mask for, and any type not named ``*attention``) carries state along
  the sequence; its ``stateful_mixers`` are read from the decoder layers of those types (the
  one child holding a ``layer_idx``, as transformers' cache-holding mixers do, and its one
  ``nn.Linear`` child back to the hidden width) and run one row per sample from a zero state
  (`ray_dhp.models.segments`). Where the module tree does not name one of each, packing is
  refused, naming the types.
"""

from __future__ import annotations

import inspect

import torch

#: what packing hands a sample's ``get_rope_index`` (`ray_dhp.data.collate`) besides the
#: images' grids: the sample's token ids and modality of each token
_ROPE_INDEX_INPUTS = ("input_ids", "mm_token_type_ids")
#: the name of the images' grids (``[n, 3]``, ``(t, h, w)`` per image) in a sample
_SAMPLE_GRID = "image_grid_thw"


def packing_rule(inner, lm, text_config, forward_params: tuple, model_cls=None,
                 grid_names: tuple = (_SAMPLE_GRID,)) -> dict:
    """The `FamilySpec` fields ``packing``, ``packing_reason``, ``packed_positions``,
    ``segment_attention`` and ``stateful_mixers``, and the `GenericFamily` field
    ``packed_masks``, for a model of class ``model_cls`` whose ``model.model`` is ``inner``,
    whose language model (decoder, on the meta device) is ``lm``, whose stock forward names
    ``forward_params`` and takes the images' grids as ``grid_names`` (module docstring)."""
    positions = "mrope" if hasattr(type(inner), "get_rope_index") else "1d"
    # per-sample attention: causal inside a sample (no bidirectional image blocks) and a forward
    # whose **kwargs carry the segments down to attention
    causal = "token_type_ids" not in forward_params and "kwargs" in forward_params
    mixers, why_not = stateful_mixers(lm, text_config)
    masks = _remapped_inputs(text_config, forward_params)
    refusal = _refusal(inner, lm, grid_names) or why_not
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
    layer whose ``layer_types`` entry is not softmax attention (`_carries_state`), its
    token-mixing child (the one child that holds a ``layer_idx``, as transformers' cache-holding
    mixers do) and that child's output projection (its one ``nn.Linear`` child back to the
    hidden width) — or ``((), why)`` where the module tree does not say."""
    types = list(getattr(text_config, "layer_types", None) or ())
    other = [i for i, t in enumerate(types) if _carries_state(t)]
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


def _carries_state(layer_type) -> bool:
    """Whether a decoder layer of ``layer_type`` (its config's ``layer_types`` entry) carries
    state along the sequence: transformers' ``masking_utils`` builds it a recurrent mask
    (``create_recurrent_attention_mask``: ``"linear_attention"``, ``"conv"``), or its type is not
    named as an attention at all."""
    from transformers import masking_utils

    recurrent = getattr(masking_utils, "create_recurrent_attention_mask", None)
    mapping = getattr(masking_utils, "LAYER_PATTERN_TO_MASK_FUNCTION_MAPPING", {})
    return (recurrent is not None and mapping.get(layer_type) is recurrent) \
        or not str(layer_type).endswith("attention")


def _refusal(inner, lm, grid_names: tuple) -> str:
    if "position_ids" not in inspect.signature(type(lm).forward).parameters:
        return "its language model's forward takes no position_ids, which packed rows restart"
    rope_index = getattr(type(inner), "get_rope_index", None)
    return "" if rope_index is None else rope_index_refusal(rope_index, grid_names)


def rope_index_refusal(rope_index, grid_names: tuple = (_SAMPLE_GRID,)) -> str:
    """Why `packed_rope_index` cannot call ``rope_index`` (the unbound ``get_rope_index``) on a
    sample alone ("" when it can): its first parameter after ``self`` must be ``input_ids``, every
    parameter without a default one packing hands (`_ROPE_INDEX_INPUTS`, ``grid_names``), and one
    of them the images' grids (``grid_names``: how the stock forward takes them)."""
    params = list(inspect.signature(rope_index).parameters.values())[1:]
    names = tuple(p.name for p in params if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD))
    given = _ROPE_INDEX_INPUTS + tuple(grid_names)
    needed = [p.name for p in params if p.default is p.empty
              and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) and p.name not in given]
    if names[:1] == ("input_ids",) and not needed and set(names) & set(grid_names):
        return ""
    why = (f"needs {tuple(needed)}" if needed else "does not start with input_ids"
           if names[:1] != ("input_ids",) else f"takes the images' grids as none of {grid_names}")
    return (f"its get_rope_index{names} {why}: packing computes each sample's positions with "
            f"{given} (the grids as the stock forward takes them)")


def packed_rope_index(get_rope_index, grids=None):
    """``get_rope_index`` (the model's bound method) behind the signature packing calls a
    sample's rule with (`ray_dhp.data.collate.pack_text_batch`: ``input_ids [1, n]``,
    ``mm_token_type_ids``, ``image_grid_thw``, ``video_grid_thw``, extras): each argument passed
    by the name its signature gives it (``mm_token_type_ids`` left out where it names none: the
    rule reads the modalities off ``input_ids``); ``grids`` (``image_grid_thw -> {name: tensor}``, e.g.
    `ray_dhp.models.generic_probe.packed_grid`): the grids as the stock forward hands them on,
    in place of ``image_grid_thw``. An input of the sample the rule takes under no name (a
    video's grid where it names none) raises: its positions would silently differ."""
    names = set(inspect.signature(get_rope_index).parameters)

    def rope_index(input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                   **extra):
        given = {"mm_token_type_ids": mm_token_type_ids, _SAMPLE_GRID: image_grid_thw,
                 "video_grid_thw": video_grid_thw, **extra}
        if grids is not None and image_grid_thw is not None:
            given.update(grids(given.pop(_SAMPLE_GRID)))
        given = {k: v for k, v in given.items() if v is not None}
        unused = sorted(k for k in given if k not in names and k != "mm_token_type_ids")
        if unused:
            raise ValueError(f"{type(get_rope_index.__self__).__name__}.get_rope_index takes no "
                             f"{unused}: a packed sample's positions cannot be computed with "
                             "what it has")
        return get_rope_index(input_ids, **{k: v for k, v in given.items() if k in names})
    return rope_index
