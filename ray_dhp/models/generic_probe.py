"""The generic family's probe of a transformers VLM (`ray_dhp.models.generic`): one
``get_image_features`` call on the meta device (or, where it cannot run there, on CPU at small
widths) gives the tower's rows per image, its pixel layout and the vision parameters no gradient
reaches; the refusals read from the model's layout (no ``get_image_features``, towers outside
``model``, a variable-resolution tower) say so without a probe."""

from __future__ import annotations

import inspect

import torch

__all__ = ["LM_ATTRS", "anyres", "UnsupportedModel", "grid_geometry", "grid_input", "image_inputs", "packed_input",
           "packed_grid", "packed_inputs", "padded_input", "padded_side", "processor_inputs", "padded_inputs", "probe", "root_of"]

LM_ATTRS = ("language_model", "text_model")


class UnsupportedModel(ValueError):
    """The model cannot be trained generically; the message says why."""


def image_inputs(names: tuple, pixel_dims: int, images: torch.Tensor, sizes=None) -> dict:
    """``get_image_features``'s keywords for ``images`` ``[n, C, H, W]``: ``pixel_values``
    (with a leading batch axis where the model takes ``[1, n, C, H, W]``, Idefics3's) and,
    where it names them, ``image_sizes`` (``[n, 2]`` heights and widths: ``sizes``, each image's
    original size where the model tiles it (`anyres`: ``images`` are then its tiles), else the
    images' own, Mistral 3's)."""
    out = {"pixel_values": images if pixel_dims == 4 else images[None]}
    if "image_sizes" in names and sizes is not None:
        out["image_sizes"] = torch.as_tensor(sizes, dtype=torch.long)
    elif "image_sizes" in names:
        out["image_sizes"] = torch.tensor([list(images.shape[-2:])] * images.shape[0],
                                          device=images.device)
    return out


def padded_input(cls) -> bool:
    """Whether the tower takes each image as its own patch rows, padded to the batch's longest,
    with the image's ``(h, w)`` patch grid (``spatial_shapes``, SigLIP 2's NaFlex input) or each
    patch's ``(x, y)`` position (``image_position_ids``, -1 on padding: Gemma 4's): its
    ``get_image_features`` names either. Such a tower takes any image size."""
    names = inspect.signature(cls.get_image_features).parameters
    return any(n in names for n in _PADDED_KEYWORDS)


_PADDED_KEYWORDS = ("spatial_shapes", "image_position_ids")


def padded_inputs(names: tuple, rows: torch.Tensor, grid: torch.LongTensor, patch: int,
                  channels: int) -> dict:
    """``get_image_features``'s keywords for a `padded_input` tower, from ray_dhp's patch rows
    ``[n*h*w, C*P*P]`` (raster order per image, each row ``(C, P, P)``) and one ``(1, h, w)``
    grid row per image: ``pixel_values [n, max h*w, P*P*C]`` (each row ``(P, P, C)``, as
    transformers' NaFlex processors patchify; zeros past an image's patches) and, where named
    (``names``: the keywords `padded_input` and `image_inputs` read), ``spatial_shapes [n, 2]``,
    ``image_position_ids [n, max h*w, 2]`` (each patch's column and row, -1 past an image's
    patches, as Gemma 4's processor makes them) and ``pixel_attention_mask [n, max h*w]`` (1 on
    an image's patches). ``spatial_shapes`` is given where no keyword is named."""
    grid = torch.as_tensor(grid, dtype=torch.long).cpu()
    rows = rows.reshape(-1, channels, patch, patch).permute(0, 2, 3, 1).reshape(rows.shape[0], -1)
    counts = grid.prod(-1).tolist()
    longest = max(counts)
    pixels = rows.new_zeros(len(counts), longest, rows.shape[-1])
    mask = torch.zeros(len(counts), longest, dtype=torch.int32, device=rows.device)
    positions = torch.full((len(counts), longest, 2), -1, dtype=torch.long)
    for k, (block, n, (_, h, w)) in enumerate(zip(rows.split(counts), counts, grid.tolist())):
        pixels[k, :n] = block
        mask[k, :n] = 1
        positions[k, :n, 0] = torch.arange(w).repeat(h)
        positions[k, :n, 1] = torch.arange(h).repeat_interleave(w)
    out = {"pixel_values": pixels}
    if "spatial_shapes" in names or "image_position_ids" not in names:
        out["spatial_shapes"] = grid[:, 1:].to(rows.device)
    if "image_position_ids" in names:
        out["image_position_ids"] = positions.to(rows.device)
    if "pixel_attention_mask" in names:
        out["pixel_attention_mask"] = mask
    return out


def processor_inputs(model_type: str) -> tuple:
    """The ``model_input_names`` of the image processor class transformers maps ``model_type``
    to (its PIL one where it has both; ``()`` where none is mapped or it cannot be imported):
    the input contract of the family's own processor."""
    try:
        from transformers.models.auto.image_processing_auto import (
            IMAGE_PROCESSOR_MAPPING_NAMES, get_image_processor_class_from_name)

        names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}
        names = names if isinstance(names, dict) else {"": names}
        for key in ("pil", *names):
            if names.get(key):
                return tuple(get_image_processor_class_from_name(names[key]).model_input_names)
    except Exception:  # noqa: BLE001 - a backend the processor needs is not installed
        pass
    return ()


def packed_input(cls, config) -> bool:
    """Whether the tower takes every image's patches packed side by side in one NaViT strip with
    each image's ``(h, w)`` patch grid (``target_sizes``, MiniCPM-V 4.6's): its
    ``get_image_features``, the base model's (``AutoModel``'s class: the top one may only pass
    ``*args`` on) or its image processor's inputs (`processor_inputs`) name ``target_sizes``.
    Such a tower takes any image size."""
    from transformers import MODEL_MAPPING

    base = MODEL_MAPPING.get(type(config), None)
    methods = [m for m in (cls.get_image_features, getattr(base, "get_image_features", None)) if m]
    return any("target_sizes" in inspect.signature(m).parameters for m in methods) or \
        "target_sizes" in processor_inputs(config.model_type)


def packed_inputs(rows: torch.Tensor, grid: torch.LongTensor, patch: int, channels: int) -> dict:
    """``get_image_features``'s keywords for a `packed_input` tower, from ray_dhp's patch rows
    ``[N, C*P*P]`` (raster order per image, each row ``(C, P, P)``) and one ``(1, h, w)`` grid
    row per image: ``pixel_values [1, C, P, N*P]`` (patch ``k`` in columns ``k*P .. k*P+P``, as
    the family's image processor's ``reshape_by_patch`` lays an image out) and ``target_sizes
    [n, 2]`` (int32, as the processor makes them)."""
    x = rows.reshape(-1, channels, patch, patch).permute(1, 2, 0, 3)
    return {"pixel_values": x.reshape(1, channels, patch, -1),
            **packed_grid(grid, rows.device)}


def packed_grid(grid: torch.LongTensor, device=None) -> dict:
    """The grid keywords a `packed_input` model takes for images of ``(1, h, w)`` grid rows:
    ``target_sizes [n, 2]`` (int32, as its processor makes them), what `packed_inputs` hands
    its tower and the stock forward its ``get_rope_index``."""
    grid = torch.as_tensor(grid, dtype=torch.long).cpu()
    return {"target_sizes": grid[:, 1:].to(device=device, dtype=torch.int32)}


def anyres(config) -> bool:
    """Whether the model tiles each image "anyres" (a config with ``image_grid_pinpoints``:
    LLaVA-NeXT's and -OneVision's): a base tile of the whole image plus the tiles of the
    pinpoint that fits it best, the tiles' rows unpadded to the image's aspect ratio with an
    ``image_newline`` row after each row of rows, so an image's rows depend on its original size
    (the ``image_sizes`` its processor gives, which ``get_image_features`` takes). The data side
    takes each image's row count from the processor (`ray_dhp.data.sample.Sample.item_rows`)
    and the vision side hands its ``image_sizes`` on (`ray_dhp.models.vision_generic`)."""
    return getattr(config, "image_grid_pinpoints", None) is not None


def _anyres_probe(model, config, channels: int, size: int, device: str) -> tuple:
    """``(pooled, 4)`` of one ``size``-px square image tiled as the model tiles it: its base
    tile and the tiles of the best pinpoint, as many as ``get_image_features`` splits off for
    that size (tried from one tile up; ``image_sizes`` stay on CPU: the model reads them as
    integers)."""
    most = max(h * w for h, w in config.image_grid_pinpoints) // (size * size)
    errors = []
    for tiles in range(2, most + 2):
        try:
            out = model.get_image_features(
                pixel_values=torch.ones(tiles, channels, size, size),
                image_sizes=torch.tensor([[size, size]], device="cpu"), return_dict=True)
            _check_no_deepstack(out)
            return out.pooler_output, 4
        except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError) as e:
            errors.append(f"{tiles} tiles: {type(e).__name__}: {e}")
    raise UnsupportedModel(f"get_image_features fails on one {size}-px anyres image ({device}); "
                           + "; ".join(errors[-2:]))


def root_of(model) -> torch.nn.Module:
    """The module that holds the tower, projector and language model: ``model.model`` (the
    layout most seam families share), or the model itself where it keeps them at its top with
    ``get_image_features`` there (Llama 4's ``vision_model``, ``language_model``)."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, torch.nn.Module) else model


def _call_probe(model, names: tuple, images: torch.Tensor):
    """``(pooled, pixel_dims)``: ``get_image_features`` on ``images`` as ``[n, C, H, W]``, or
    as ``[1, n, C, H, W]`` where the model takes a batch of image lists (``images``: not all
    zeros, which Idefics3 takes for padding)."""
    errors = []
    for dims in (4, 5):
        try:
            out = model.get_image_features(**image_inputs(names, dims, images), return_dict=True)
            _check_no_deepstack(out)
            return out.pooler_output, dims
        except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError) as e:
            errors.append(f"as {dims}-D pixels: {type(e).__name__}: {e}")
    raise UnsupportedModel(f"get_image_features fails on one {tuple(images.shape[-2:])} image "
                           f"({images.device.type}); " + "; ".join(errors))


def _check_no_deepstack(out) -> None:
    """Refuse towers whose features come with more than the pooled rows (``deepstack_features``
    for several LM layers, Ovis2's ``visual_indicator_features``): the stock forward reads them
    from ``mm_encoder_outputs``, and the generic family hands only the rows through yet."""
    extra = sorted(k for k, v in out.items() if v is not None and k not in _PLAIN_OUTPUTS)
    if extra:
        raise UnsupportedModel(f"its get_image_features returns {', '.join(extra)} besides the "
                               "feature rows, which the generic family does not hand to the "
                               "language model yet")


_IMAGE_KEYWORDS = ("image_sizes", "pixel_attention_mask") + _PADDED_KEYWORDS  # further keywords
#                                                  `image_inputs` and `padded_inputs` pass where named
_PLAIN_OUTPUTS = ("pooler_output", "last_hidden_state", "hidden_states", "attentions")


def grid_input(cls, vc) -> bool:
    """Whether the tower takes patch rows with an ``image_grid_thw``: its
    ``get_image_features`` names ``image_grid_thw`` and its config has an integer
    ``patch_size`` (GLM-4V's, with Qwen's ``spatial_merge_size`` and ``temporal_patch_size``;
    Kimi-K2.5's, whose merge the probe reads from the rows: `grid_geometry`)."""
    if not hasattr(cls, "get_image_features"):
        raise UnsupportedModel(f"{cls.__name__} has no get_image_features (the seam the generic "
                               "family runs the vision side through)")
    names = inspect.signature(cls.get_image_features).parameters
    return "image_grid_thw" in names and isinstance(getattr(vc, "patch_size", None), int)


def grid_geometry(vc) -> tuple:
    """``(patch, temporal patch, merge or None, probe side)`` of a `grid_input` tower: the
    config's ``spatial_merge_size`` / ``temporal_patch_size`` where it has them (Qwen's names),
    else one frame a patch row and the merge read from the probe's rows."""
    m = getattr(vc, "spatial_merge_size", None)
    m = m if isinstance(m, int) else None
    t = getattr(vc, "temporal_patch_size", None)
    return vc.patch_size, t if isinstance(t, int) else 1, m, 2 * m if m else PADDED_SIDE


def _grid_probe(model, vc, channels: int, device: str) -> tuple:
    """``(pooled, pixel dims)`` of one square image as patch rows ``[N, C*T*P*P]`` (dims 2) or,
    where the tower takes them so (Kimi-K2.5's), patch images ``[N, C, P, P]`` (dims 4)."""
    p, t, _, side = grid_geometry(vc)
    errors = []
    for dims in (2, 4):
        rows = torch.ones(side * side, channels * t * p * p)
        try:
            out = model.get_image_features(
                pixel_values=rows if dims == 2 else rows.reshape(-1, channels, p, p),
                image_grid_thw=torch.tensor([[1, side, side]]), return_dict=True)
            _check_no_deepstack(out)
            return out.pooler_output, dims
        except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError) as e:
            errors.append(f"as {'patch rows' if dims == 2 else 'patch images'}: {type(e).__name__}: {e}")
        if t != 1:
            break
    raise UnsupportedModel(f"get_image_features fails on one {side}x{side}-patch image "
                           f"({device}); " + "; ".join(errors))


class _LayoutRefusal(UnsupportedModel):
    """A refusal read from the model's layout or config (the same on any device)."""


def probe(config, cls, grid: bool = False, padded: bool = False, packed: bool = False,
          tiled: bool = False):
    """`_probe_on` the meta device; where ``get_image_features`` cannot run there (shapes that
    depend on values), on CPU with a copy of the config of small widths (`shrink_config`: the
    same depths and image geometry, so the same rows and the same unused parameters)."""
    try:
        return _probe_on(config, cls, "meta", grid, padded=padded, packed=packed, tiled=tiled)
    except _LayoutRefusal:
        raise  # the model's layout, not the meta device: a CPU probe would say the same
    except UnsupportedModel as meta_error:
        from ray_dhp.models.shrink import shrink_config

        try:
            # one text layer: get_image_features never reaches the language model
            small = shrink_config(config, text={"num_hidden_layers": 1})
        except Exception as e:  # noqa: BLE001 - the config class refused the small copy
            raise UnsupportedModel(f"{meta_error}; no small copy of the config for a CPU probe "
                                   f"({type(e).__name__}: {' '.join(str(e).split())})") from None
        errors = []
        for side in _cpu_sides(config.vision_config):  # a small image first: a real backward
            try:
                return _probe_on(small, cls, "cpu", grid, side if not tiled else None,
                                 padded=padded, packed=packed, tiled=tiled)
            except UnsupportedModel as e:
                errors.append(str(e))
        raise UnsupportedModel(f"{meta_error}; on CPU at small widths: {'; '.join(errors)}")


def _cpu_sides(vc) -> list:
    """Image sides for a CPU probe: 16 patches a side (towers that take any size: Pixtral's
    1540-px maximum would cost minutes), then the tower's own size."""
    size, patch = getattr(vc, "image_size", None), getattr(vc, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int):
        return [size]
    return [16 * patch, size] if size > 16 * patch else [size]


#: patches a side of a `padded_input` tower's probe image (a multiple of any merge size up to 4
#: but 3), then the side tried where a tower refuses it (a multiple of 3: Gemma 4's 3x3 pooling)
PADDED_SIDE = 8
PADDED_SIDES = (PADDED_SIDE, 12)


def padded_side(merge: int) -> int:
    """The probe side (`PADDED_SIDES`) of a padded or packed tower whose rows pool ``merge`` x
    ``merge`` patches."""
    return next((n for n in PADDED_SIDES if n % merge == 0), PADDED_SIDE)


def _probe_on(config, cls, device: str, grid: bool = False, side=None, padded: bool = False,
              packed: bool = False, tiled: bool = False):
    """``(pooler_output, inner model, unused, (image keywords, pixel dims), image side)`` of one
    image (``side`` px a side, default the tower's ``image_size``) through the model's own
    ``get_image_features``, built and run on the meta device (shapes only, no memory);
    the image keywords and pixel dims `image_inputs` takes; ``unused``: the vision parameters
    no gradient reaches (a meta backward), e.g. the last
    tower layer of a model that takes the features of the one before (LLaVA's
    ``vision_feature_layer=-2``): the stock model never steps them, so neither does the engine."""
    vc = config.vision_config
    channels = getattr(vc, "in_channels", None) or getattr(vc, "num_channels", 3)
    names = tuple(inspect.signature(cls.get_image_features).parameters)
    with torch.device(device):
        try:
            model = cls._from_config(config)
            root = root_of(model)
        except Exception as e:  # noqa: BLE001 - e.g. a tower that needs timm
            raise UnsupportedModel(f"{cls.__name__} cannot be built ({device}): "
                                   f"{type(e).__name__}: {' '.join(str(e).split())[:300]}") from None
        if grid:  # one image of 2m x 2m patches (PADDED_SIDE a side without a merge size)
            pooled, dims = _grid_probe(root, vc, channels, device)
        elif padded or packed:  # one image of n x n patches (`PADDED_SIDES`, the first taken)
            p, errors = vc.patch_size, []
            for n in PADDED_SIDES:
                rows, one = torch.ones(n * n, channels * p * p), torch.tensor([[1, n, n]])
                try:
                    out = root.get_image_features(
                        **(packed_inputs(rows, one, p, channels) if packed else
                           padded_inputs(names, rows, one, p, channels)), return_dict=True)
                    _check_no_deepstack(out)
                    pooled, side = out.pooler_output, n
                    break
                except (ValueError, TypeError, RuntimeError, IndexError, NotImplementedError) as e:
                    errors.append(f"{n}x{n}: {type(e).__name__}: {e}")
            else:
                raise UnsupportedModel(f"get_image_features fails on one image as "
                                       f"{'packed' if packed else 'padded'} patch rows ({device}): "
                                       + "; ".join(errors)) from None
            dims = 3
        elif tiled:  # an anyres image at the tower's tile size (`anyres`)
            size = vc.image_size
            pooled, dims = _anyres_probe(root, config, channels, size, device)
        else:
            size = side or getattr(vc, "image_size", None)
            if not isinstance(size, int):
                made = processor_inputs(config.model_type)
                raise _LayoutRefusal(
                    f"its vision config ({type(vc).__name__}) has no fixed image_size and its "
                    "tower takes no image_grid_thw, spatial_shapes or target_sizes: a "
                    "variable-resolution tower (rows from each image's own size) in a form the "
                    "generic family does not cover yet" + (
                        f" (its image processor makes {', '.join(made)})" if made else ""))
            pooled, dims = _call_probe(root_of(model), names, torch.ones(1, channels, size, size))
        total = sum(p.sum() for p in pooled) if isinstance(pooled, (list, tuple)) else pooled.sum()
        named = [(n, p) for n, p in root.named_parameters()
                 if not n.startswith(LM_ATTRS) and p.requires_grad]
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
    unused = tuple(n for (n, _), g in zip(named, grads) if g is None)
    probed = None if grid else side if padded or packed else size
    return pooled, root, unused, (tuple(n for n in names if n in _IMAGE_KEYWORDS), dims), probed
