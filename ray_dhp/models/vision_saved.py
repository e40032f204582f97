"""What a generic family's vision side saves for backward, measured from the model's own code
(`ray_dhp.models.generic`): one ``get_image_features`` call on the meta device (shapes only, no
memory, at any width) at the family probe's image (`ray_dhp.models.generic_probe`), under
``torch.autograd.graph.saved_tensors_hooks``, each saved storage counted once at its full size
(identity: the storage's ``_cdata``, which meta storages have), parameters and views of them
excluded, as `benchmarks/measure.py` counts a real step's. The bytes split into those first saved
while one of the encoder's layers runs (the list of ``num_hidden_layers`` layers
`ray_dhp.models.vision_generic_sp` cuts over Ulysses SP ranks) and the rest (embeddings,
post-norm, projector: whole on every SP rank); each per patch token of the probe's image, so
they scale with the tokens a plan gives.

What it cannot see: anything that is not a saved tensor (the planner's transients, autocast's
weight casts: `ray_dhp.planning.memory.weight_cast_bytes`), work that depends on the image size
other than linearly (an eager attention's ``s²`` scores: the probe runs the tower's attention
through SDPA, the planner adds eager scores by formula), bf16 autocast's fp32 upcasts (the
probe runs the model in the activation dtype), and kernels whose meta implementation saves other
tensors than their CPU / CUDA one. `vision_saved_per_token` returns None where the meta call
fails (the family's probe then ran on CPU at small widths): the planner keeps its block formula.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Optional

import torch

__all__ = ["vision_saved_per_token"]

_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


def vision_saved_per_token(config, family, dtype_bytes: int) -> Optional[tuple]:
    """``(layers, rest)`` bytes per patch token the vision side of ``config`` (a
    `GenericFamily` ``family``'s) saves for backward at ``dtype_bytes`` per activation element,
    or None where the meta probe cannot run (module docstring). Cached per (config, dtype)."""
    import transformers

    cls = getattr(transformers, family.model_class)
    return _measure(cls, config.to_json_string(use_diff=False), family, _DTYPES[dtype_bytes])


def _is_param(t: torch.Tensor) -> bool:
    while t is not None:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base
    return False


def _inputs(family, root, vc, names: tuple) -> tuple:
    """``(keywords, patch tokens)`` of the family probe's image for ``get_image_features``."""
    from ray_dhp.models.generic_probe import (grid_geometry, image_inputs, packed_inputs,
                                              padded_inputs, padded_side)

    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3)
    if family.grid_input:
        p, t, _, side = grid_geometry(vc)
        rows = torch.ones(side * side, channels * t * p * p)
        if family.pixel_dims == 4:
            rows = rows.reshape(-1, channels, p, p)
        return {"pixel_values": rows, "image_grid_thw": torch.tensor([[1, side, side]])}, side * side
    if family.padded_input or family.packed_input:
        n, p = padded_side(family.merge_size(None)), vc.patch_size
        if family.packed_input:
            return packed_inputs(torch.ones(n * n, channels * p * p), torch.tensor([[1, n, n]]),
                                 p, channels), n * n
        return padded_inputs(names, torch.ones(n * n, channels * p * p), torch.tensor([[1, n, n]]),
                             p, channels), n * n
    size, patch = vc.image_size, vc.patch_size
    return (image_inputs(names, family.pixel_dims, torch.ones(1, channels, size, size)),
            (size // patch) ** 2)


class _FusedAttention(torch.overrides.TorchFunctionMode):
    """SDPA as the fused CPU kernel (``_scaled_dot_product_flash_attention_for_cpu``: saves q,
    k, v, the output and the log-sum-exp, as on CPU and as CUDA's flash kernels do), where the
    meta device would take the math path (which saves the ``s²`` probabilities); with value
    heads narrower than the query's (multi-head latent attention) CUDA's memory-efficient kernel,
    which saves the same (CPU's SDPA takes the math path there)."""

    def fused(self, args, kwargs):
        """The fused kernel's outputs for an SDPA call (the output first) and the k, v it was
        given (repeated to the query heads under ``enable_gqa``), or None where it cannot run."""
        q, k, v = args[:3]
        mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            k, v = (x.repeat_interleave(q.shape[-3] // x.shape[-3], -3) for x in (k, v))
        try:
            if v.shape[-1] != q.shape[-1]:  # value heads narrower (MLA): CUDA's efficient
                if mask is not None and mask.dtype == torch.bool:  # kernel, which saves the same
                    mask = torch.zeros(mask.shape, dtype=q.dtype).masked_fill(~mask, float("-inf"))
                return torch.ops.aten._scaled_dot_product_efficient_attention(
                    q, k, v, mask, True, kwargs.get("dropout_p", 0.0),
                    kwargs.get("is_causal", False), scale=kwargs.get("scale")) + (k, v)
            return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, kwargs.get("dropout_p", 0.0), kwargs.get("is_causal", False),
                attn_mask=mask, scale=kwargs.get("scale")) + (k, v)
        except (RuntimeError, TypeError, NotImplementedError):
            return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            got = self.fused(args, kwargs)
            if got is not None:
                return got[0]
        try:
            out = func(*args, **kwargs)
        except RuntimeError as e:  # integers kept on CPU (values read) meeting meta tensors
            if "device" not in str(e):
                raise
            from torch.utils._pytree import tree_map

            def to_meta(x):
                return x.to("meta") if isinstance(x, torch.Tensor) and x.device.type == "cpu" else x

            return func(*tree_map(to_meta, args), **tree_map(to_meta, kwargs))
        if func is torch.Tensor.to and isinstance(out, torch.Tensor) and out.is_meta:
            x = args[0]  # integers kept on CPU stay there when sent to the model's device (the
            if x.device.type == "cpu" and not x.is_floating_point():  # code reads their values:
                return x.to(out.dtype)  # MiniCPM-V's window lengths, ``.tolist()``)
        return out


@functools.lru_cache(maxsize=None)
def _measure(cls, config_json: str, family, dtype) -> Optional[tuple]:
    import json

    from ray_dhp.models.generic_probe import root_of
    from ray_dhp.models.vision_generic_sp import _layer_list

    config = cls.config_class.from_dict(json.loads(config_json))
    vc = config.vision_config
    if getattr(vc, "_attn_implementation", None) == "eager":  # s² scores: by formula (docstring)
        try:
            vc._attn_implementation = "sdpa"
        except Exception:  # noqa: BLE001 - a tower without SDPA: its probe keeps eager
            pass
    names = tuple(inspect.signature(cls.get_image_features).parameters)
    counted = {"layers": 0, "rest": 0}
    seen, inside = set(), [0]

    def pack(t):
        if not _is_param(t):
            st = t.untyped_storage()
            if st._cdata not in seen and st._cdata not in params:
                seen.add(st._cdata)
                keep.append(st)  # the id stays this storage's while counting
                counted["layers" if inside[0] else "rest"] += st.nbytes()
        return t

    with torch.device("meta"):
        model = cls._from_config(config, dtype=dtype)
    root = root_of(model)
    params = {p.untyped_storage()._cdata for p in root.parameters()}
    for n, p in root.named_parameters():  # frozen as the engine holds them: their inputs unsaved
        p.requires_grad_(n not in family.vision_unused)
    lists = _layer_list(getattr(root, family.tower), getattr(vc, "num_hidden_layers", 0) or 0)
    for layer in (lists[0][1] if len(lists) == 1 else ()):
        layer.register_forward_pre_hook(lambda *_: inside.__setitem__(0, inside[0] + 1))
        layer.register_forward_hook(lambda *_: inside.__setitem__(0, inside[0] - 1))
    for cpu_ints in (False, True):  # the integer inputs (sizes, grids) on CPU where the code
        counted.update(layers=0, rest=0)  # reads their values (`.tolist()`, `.item()`)
        seen.clear()
        inside[0] = 0
        keep: list = []
        kwargs, tokens = _inputs(family, root, vc, names)
        kwargs = {k: v if cpu_ints and not v.is_floating_point() else v.to("meta")
                  for k, v in kwargs.items()}
        try:
            # values read: factories without a device stay on CPU (moved to meta where they meet
            # the model's tensors, `_FusedAttention`)
            with (contextlib.nullcontext() if cpu_ints else torch.device("meta")), \
                    _FusedAttention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                root.get_image_features(**kwargs, return_dict=True)
        except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError):
            continue  # shapes that depend on values: the meta device cannot run it
        return counted["layers"] / tokens, counted["rest"] / tokens
    return None
