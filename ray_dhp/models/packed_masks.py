"""Packed rows' attention masks built by the model's own mask code, one sample at a time.

transformers builds a packed row's masks from the restarting positions
(``masking_utils.find_packed_sequence_indices``): it evaluates the mask rule at the *packed
positions* and ANDs the block-diagonal mask onto it. That is exact for a rule of positions only
(causal, a sliding window's distances) and for ``block_sequence_ids`` (looked up at row
indices), but not for a rule that looks a per-token input up through an ``or_mask_function``
composed before that remapping: Gemma 3's sliding-window layers read their image blocks (from
``token_type_ids``) at the packed positions, i.e. at the first sample's tokens of the row.

A model whose class defines ``create_masks_for_generate`` (transformers' generation contract:
it returns the per-layer-type mask mapping the model's ``forward`` then takes as
``attention_mask``, skipping its own mask code) gets the mapping built here instead
(`packed_mask_mapping`): each segment of a packed row (each sample and the row's padded tail,
found where the positions restart, as transformers finds them) gets its masks from
``create_masks_for_generate`` called on that segment **alone** (its own per-token inputs,
positions ``0..n-1``, no padding mask), i.e. exactly the masks the sample gets one per row;
they are placed on the block diagonal of the packed row, and nothing else is attended. A sample
thus attends exactly what it attends alone. `ray_dhp.models.generic_packing` decides which
models need it (a mask that reads per-token inputs other than the positions on layers whose
rule transformers remaps); its code names no family (Gemma 3 above is the example).

The mapping is in the model's attention implementation's format: ``sdpa``: boolean
``[R, 1, L, L]``; ``eager``: additive (0 where attended, the dtype's lowest value elsewhere).
Any other implementation raises (its masks are not tensors this module can place).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["packed_mask_mapping", "segments_of_positions"]

_FORMATS = ("sdpa", "eager")


def segments_of_positions(positions: torch.Tensor) -> list[list[tuple[int, int]]]:
    """``[(start, end), ...]`` per row of ``positions`` ``[R, L]``: a segment starts where the
    positions do not continue by one (transformers' packed-sequence rule)."""
    out = []
    for row in positions.to("cpu", torch.long):
        starts = [0] + [i + 1 for i in torch.nonzero(row[1:] - row[:-1] != 1).flatten().tolist()]
        out.append(list(zip(starts, starts[1:] + [int(row.shape[0])])))
    return out


def _as_bool(mask, n: int, device) -> torch.Tensor:
    """One segment's mask ``[n, n]`` as booleans (True: attended) from the format
    ``create_masks_for_generate`` returned it in (None: sdpa's skipped plain causal mask)."""
    if mask is None:
        return torch.ones(n, n, dtype=torch.bool, device=device).tril()
    if not isinstance(mask, torch.Tensor):
        raise ValueError(f"packed masks: the model's mask is a {type(mask).__name__}, not a tensor "
                         f"(attention implementations covered: {_FORMATS})")
    mask = mask.reshape(mask.shape[-2], mask.shape[-1])
    return mask if mask.dtype == torch.bool else mask == 0


def packed_mask_mapping(model_cls, config, position_ids: torch.Tensor, *,
                        dtype: Optional[torch.dtype] = None, **per_token) -> dict | torch.Tensor:
    """The ``attention_mask`` mapping of a packed batch (module docstring) for a model of class
    ``model_cls`` (its ``create_masks_for_generate``) with ``config``: ``position_ids``
    ``[R, L]`` (or M-RoPE's ``[k, R, L]``, row 0 the text positions); ``per_token``: the
    ``[R, L]`` inputs the mask reads (``token_type_ids``, ...), each segment's slice handed in;
    ``dtype``: the model's (eager's additive masks)."""
    text = config.get_text_config()
    impl = getattr(text, "_attn_implementation", None) or "sdpa"
    if impl not in _FORMATS:
        raise ValueError(f"packed masks cover the attention implementations {_FORMATS}, the model "
                         f"runs {impl!r}")
    pos = position_ids if position_ids.dim() == 2 else position_ids[0]
    rows, length = pos.shape
    device, dtype = pos.device, dtype or getattr(text, "dtype", None) or torch.float32
    packed: dict = {}
    for r, segments in enumerate(segments_of_positions(pos)):
        for a, b in segments:
            n = b - a
            given = {k: v[r:r + 1, a:b] for k, v in per_token.items() if v is not None}
            masks = model_cls.create_masks_for_generate(
                config=config, inputs_embeds=torch.empty((1, n, 0), dtype=dtype, device=device),
                attention_mask=None, cache=None, position_ids=torch.arange(n, device=device)[None],
                is_first_iteration=True, **given)
            for key, mask in (masks.items() if isinstance(masks, dict) else [(None, masks)]):
                full = packed.setdefault(key, torch.zeros(rows, length, length, dtype=torch.bool,
                                                          device=device))
                full[r, a:b, a:b] = _as_bool(mask, n, device)
    out = {k: _formatted(v, impl, dtype) for k, v in packed.items()}
    return out[None] if None in out else out


def _formatted(mask: torch.Tensor, impl: str, dtype: torch.dtype) -> torch.Tensor:
    mask = mask[:, None]  # [R, 1, L, L]
    if impl == "sdpa":
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
        ~mask, torch.finfo(dtype).min)
