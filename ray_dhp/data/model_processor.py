"""A model's own transformers processor as a `VLProcessor`: the prompt, the image tokens and the
pixels exactly as transformers' processor of the model makes them, for any model whose
processor follows ``ProcessorMixin``'s multimodal protocol (the generic families,
`ray_dhp.models.generic`; `ray_dhp.data.processing.as_vl_processor` picks it for them).

What is read from the processor (nothing is written per model):

* ``chat_template`` (else the tokenizer's) renders the conversation; the template writes each
  image item as the processor's ``image_token`` (a begin-of-image token, or the row token
  itself);
* ``image_processor`` makes the pixels and ``replace_image_token(pixels, i)`` the text the i-th
  image's placeholder becomes (begin/end-of-image tokens around one soft token per feature
  row, or the row token repeated), as ``ProcessorMixin.__call__`` expands it;
* ``image_token_ids``: the tokens that hold an image's feature rows (``mm_token_type_ids`` 1
  there, as ``ProcessorMixin.create_mm_token_type_ids`` marks them);
* the end of a reply (`reply_end`): the first special token the template writes after an
  assistant turn's content (an end-of-turn token, or the eos), trained with the reply, as
  the default prompt format trains its ``<|im_end|>``; a template that writes none trains the
  content and what it writes up to the next turn.

Pixels: fixed-size images ``[n, C, S, S]`` become patch rows with the grid ``(1, S/P, S/P)``
(`ray_dhp.data.tiles.tile_rows`; the tower's shell turns them back into images), the layout
every data mechanism counts feature rows in; a processor that gives patch rows with an
``image_grid_thw`` is taken as it is; one that gives padded patch rows with each patch's
position (``image_position_ids``) becomes patch rows and grids (`positioned_rows`), its own
placeholder counts (``num_soft_tokens_per_image``) checked against them; an anyres processor's
tiles (``[n, tiles, C, S, S]`` with ``image_sizes``, from ``image_grid_pinpoints``) become each
image's tiles as patch rows with the grid ``(tiles, S/P, S/P)``, its ``image_sizes`` and its rows
as the processor counts them (`ModelProcessor._tiled`; `Sample.item_rows`). Records with videos or audio are bad samples
here (the reason is named): this path covers images.

`run_processor` is how a run gets its processor: for a family whose samples its own processor
makes (``FamilySpec.model_processor``: the generic families), a model directory or a
transformers processor becomes a `ModelProcessor`; anything else goes through
`ray_dhp.data.processing.as_vl_processor` as before (a `VLProcessor` given is used as it is).

Example::

    from transformers import AutoProcessor
    proc = ModelProcessor(AutoProcessor.from_pretrained(local_dir), patch_size=14, merge_size=4)
    sample = proc.process(record, data_root)      # input_ids, labels, mm_token_type_ids, pixels
"""

from __future__ import annotations

import torch

from ray_dhp.data.chat import (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
                               TemplateRenderer)
from ray_dhp.data.processing import VLProcessor, as_vl_processor, pick_template
from ray_dhp.data.sample import BadSample
from ray_dhp.data.tiles import tile_rows

__all__ = ["ModelProcessor", "reply_end", "run_processor"]

_SENTINEL = "ray_dhp_reply_sentinel"


def reply_end(tokenizer, chat_template: str):
    """The special token the template writes right after an assistant turn's content (only
    whitespace between), or None: it ends the reply, and is trained with it."""
    renderer = TemplateRenderer(tokenizer, chat_template, end_of_turn=None)
    text = renderer.text([("user", "x"), ("assistant", _SENTINEL)])
    after = text[text.rfind(_SENTINEL) + len(_SENTINEL):].lstrip(" ")
    specials = sorted({str(t) for t in tokenizer.all_special_tokens} |
                      {a.content for a in getattr(tokenizer, "added_tokens_decoder", {}).values()
                       if getattr(a, "special", False)}, key=len, reverse=True)
    return next((s for s in specials if s and after.startswith(s)), None)


class ModelProcessor(VLProcessor):
    """A transformers multimodal processor (``AutoProcessor`` of the model's directory) behind
    the `VLProcessor` interface (see the module docstring).

    Args:
        processor: the model's processor: ``tokenizer``, ``image_processor``, ``image_token``,
            ``replace_image_token`` and a chat template (its own or the tokenizer's).
        patch_size: the tower's patch side ``P`` (fixed-size images become ``(S/P)**2`` rows).
        merge_size: patches per side of one feature row (the family's ``merge_size``).
        system_prompt, chat_template: as `VLProcessor`'s.
    """

    def __init__(self, processor, *, patch_size: int, merge_size: int, system_prompt=None,
                 chat_template=None):
        missing = [a for a in ("tokenizer", "image_processor", "image_token", "replace_image_token")
                   if getattr(processor, a, None) is None]
        if missing:
            raise ValueError(f"{type(processor).__name__} lacks {', '.join(missing)}: not a "
                             "transformers multimodal processor")
        self.processor, self.patch_size = processor, patch_size
        template = pick_template(chat_template, processor)
        if not template and not getattr(processor.tokenizer, "chat_template", None):
            raise ValueError(f"{type(processor).__name__} has no chat template (the model's own "
                             "prompt format is what this processor renders)")
        super().__init__(processor.tokenizer, processor.image_processor,
                         system_prompt=system_prompt, chat_template=template)
        self.pads = (processor.image_token, None, None)
        self.merge_size = merge_size

    # -- the hooks of VLProcessor -------------------------------------------------------------

    def _renderer(self, tokenizer, template):
        return TemplateRenderer(tokenizer, template, end_of_turn=reply_end(tokenizer, template))

    def _token_ids(self, tokenizer) -> dict:
        image = [i for i in self.processor.image_token_ids if i is not None]
        if not image:
            raise ValueError(f"{type(self.processor).__name__} names no image token ids")
        return {"image": tuple(image)}

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        mm = torch.zeros_like(input_ids)
        mm[torch.isin(input_ids, torch.tensor(self.ids["image"]))] = 1
        return mm

    def _reserved(self) -> list:
        ours = {IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER}
        words = set(map(str, self.tokenizer.all_special_tokens)) | set(
            self.processor.all_special_multimodal_tokens)
        return sorted(w for w in words if w and w not in ours)

    def encode_images(self, images: list):
        if not images:
            return None, None, [], {}
        try:
            out = self.image_processor(images=images, return_tensors="pt")
            reps = [self.processor.replace_image_token(out, image_idx=i) for i in range(len(images))]
        except Exception as exc:  # noqa: BLE001 - the processor refuses the image
            raise BadSample(f"image processor refused the image(s): {type(exc).__name__}: "
                            f"{exc}") from exc
        pixels = out["pixel_values"].to(torch.float32)
        if pixels.dim() == 5 and out.get("image_sizes") is not None:  # each image's tiles
            return self._tiled(images, reps, out["image_sizes"])
        if pixels.shape[0] != len(images) and out.get("image_grid_thw") is None:
            raise ValueError(f"{type(self.image_processor).__name__} makes {pixels.shape[0]} "
                             f"pixel tensors of {len(images)} image(s) (crops of an image: e.g. "
                             "pan-and-scan); the model processor path takes one "
                             "fixed-size image per image")
        if out.get("image_grid_thw") is not None:  # patch rows with their grid already
            return pixels, out["image_grid_thw"].to(torch.long), reps, {}
        if out.get("image_position_ids") is not None:  # padded patch rows with their positions
            rows, grid = positioned_rows(pixels, out["image_position_ids"], self.patch_size)
            _check_counts(out, grid, self.merge_size, type(self.image_processor).__name__)
            return rows, grid, reps, {}
        side, p = pixels.shape[-1], self.patch_size
        if pixels.dim() != 4 or pixels.shape[-2] != side or side % (p * self.merge_size):
            raise ValueError(f"{type(self.image_processor).__name__} gives pixels of shape "
                             f"{tuple(pixels.shape)}: the model processor path takes fixed "
                             f"square images of a multiple of {p * self.merge_size} px")
        grid = torch.tensor([[1, side // p, side // p]] * pixels.shape[0], dtype=torch.long)
        return tile_rows(pixels, p), grid, reps, {}

    def _tiled(self, images: list, reps: list, sizes) -> tuple:
        """An anyres processor's images (``[n, tiles, C, S, S]`` padded to the most tiles, with
        each image's original ``image_sizes``): each image's own tiles (the processor run on it
        alone: no padding) as patch rows with the grid ``(tiles, S/P, S/P)``, and its feature
        rows as the processor counts them (the row tokens of its ``replace_image_token``)."""
        words = [w for w in self.tokenizer.convert_ids_to_tokens(list(self.ids["image"])) if w]
        counts = [sum(r.count(w) for w in words) for r in reps]
        rows, grids, p = [], [], self.patch_size
        for image in images:
            tiles = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
            if tiles.shape[-1] != tiles.shape[-2]:
                raise ValueError(f"{type(self.image_processor).__name__} makes tiles of "
                                 f"{tuple(tiles.shape[-2:])} px: not square")
            k = tiles.shape[-1] // p  # whole patches: the tower's stride-P patch convolution
            tiles = tiles[..., :k * p, :k * p]  # never reads the rest (384 px / 14: 27 a side)
            rows.append(tile_rows(tiles.to(torch.float32), p))
            grids.append([tiles.shape[0], tiles.shape[-1] // p, tiles.shape[-1] // p])
        per_image = {"image_sizes": torch.as_tensor(sizes, dtype=torch.long).reshape(-1, 2),
                     "item_rows": torch.tensor(counts, dtype=torch.long)}
        return torch.cat(rows), torch.tensor(grids, dtype=torch.long), reps, per_image

    def _encode_video(self, source, max_pixels):
        raise BadSample("a video: the model's own processor path covers images only")

    # -- the rest of the interface ------------------------------------------------------------

    def configured(self, *, system_prompt=None, min_pixels=None, max_pixels=None,
                   video=None) -> "ModelProcessor":
        """A copy with this system prompt (pixel limits and video settings belong to the
        resizing processors of the default format; set here they are refused)."""
        if min_pixels is not None or max_pixels is not None:
            raise ValueError("min_pixels/max_pixels resize images by pixel count; this model's "
                             "processor makes images of its own fixed size")
        out = ModelProcessor(self.processor, patch_size=self.patch_size, merge_size=self.merge_size,
                             system_prompt=system_prompt, chat_template=self.renderer.chat_template)
        out.chat_source = self.chat_source
        return out

    def save_pretrained(self, directory) -> None:
        """Write the whole transformers processor (``AutoProcessor`` reads it back)."""
        self.processor.save_pretrained(directory)


def positioned_rows(pixels: torch.Tensor, positions: torch.Tensor, patch: int) -> tuple:
    """ray_dhp's patch rows ``[N, C*P*P]`` (raster order per image, each row ``(C, P, P)``) and
    ``(1, h, w)`` grids from padded patch rows ``[n, L, P*P*C]`` (each row ``(P, P, C)``) with
    each patch's ``(x, y)`` (``image_position_ids [n, L, 2]``, -1 on padding, as such an image
    processor gives them); the inverse of `ray_dhp.models.generic_probe.padded_inputs`. Raises ValueError
    where an image's patches are not its whole raster grid in raster order."""
    blocks, grid = [], []
    for x, pos in zip(pixels, torch.as_tensor(positions, dtype=torch.long)):
        pos = pos[(pos >= 0).all(-1)]
        h, w = (int(pos[:, 1].max()) + 1, int(pos[:, 0].max()) + 1) if len(pos) else (0, 0)
        raster = torch.stack([torch.arange(w).repeat(h), torch.arange(h).repeat_interleave(w)], -1)
        if not len(pos) or pos.shape != raster.shape or not torch.equal(pos, raster):
            raise ValueError("image_position_ids that are not one image's whole patch grid in "
                             "raster order, first: the model processor path cannot lay them out")
        c = x.shape[-1] // (patch * patch)
        blocks.append(x[:len(pos)].reshape(-1, patch, patch, c).permute(0, 3, 1, 2).reshape(len(pos), -1))
        grid.append([1, h, w])
    return torch.cat(blocks), torch.tensor(grid, dtype=torch.long)


def _check_counts(out, grid: torch.Tensor, merge: int, name: str) -> None:
    """The processor's own count of each image's placeholder rows (``num_soft_tokens_per_image``,
    where it gives one) must be the rows ray_dhp counts: ``h * w / merge**2`` per image."""
    given = out.get("num_soft_tokens_per_image")
    if given is None:
        return
    ours = (grid[:, 1] * grid[:, 2] // (merge * merge)).tolist()
    if [int(n) for n in torch.as_tensor(given).reshape(-1).tolist()] != ours:
        raise ValueError(f"{name} counts {list(map(int, torch.as_tensor(given).reshape(-1)))} "
                         f"soft tokens per image, the patch grids {grid[:, 1:].tolist()} give "
                         f"{ours} rows of {merge}x{merge} patches")


def run_processor(spec, model) -> VLProcessor:
    """The run's processor from ``spec`` (a `VLProcessor`, a directory, a transformers processor
    or a tokenizer) for ``model`` (its transformers config or directory; None: unknown), see
    the module docstring.

    A directory whose processor does not load as a multimodal transformers processor is read
    as `ray_dhp.data.processing.load_processor` reads it (the default prompt format; the driver's
    `ray_dhp.data.compat.check_processor_fits` then checks its tokens against the model).

    Raises:
        ProcessorDirError: a directory that loads neither way (both reasons named).
    """
    import os

    from ray_dhp.data.processor_dir import ProcessorDirError
    from ray_dhp.models import family_of, load_model_config

    if isinstance(spec, VLProcessor) or model is None:
        return as_vl_processor(spec)
    config = load_model_config(model)
    try:
        family = family_of(config)
    except ValueError:  # a model ray_dhp refuses (the driver says why)
        return as_vl_processor(spec)
    if not family.model_processor:
        return as_vl_processor(spec, family.prompt_format)
    geometry = dict(patch_size=config.vision_config.patch_size, merge_size=family.merge_size(config))
    if not isinstance(spec, (str, os.PathLike)):
        return ModelProcessor(spec, **geometry) if hasattr(spec, "replace_image_token") \
            else as_vl_processor(spec)
    path = os.fspath(spec)
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(path, local_files_only=True)
        out = ModelProcessor(processor, **geometry)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        own = (f"the model's own processor ({config.model_type}) does not load as a multimodal "
               f"transformers processor: {type(e).__name__}: {' '.join(str(e).split())[:300]}")
        try:  # a directory in the default prompt format (what ray_dhp's demo writes)
            return as_vl_processor(path)
        except ProcessorDirError as default:
            raise ProcessorDirError(f"processor directory {path}: {own}; nor in the default "
                                    f"prompt format: {default}") from e
    from ray_dhp.data.processor_dir import find_chat_template

    source = find_chat_template(path)[1]
    out.chat_source = os.path.join(path, source) if source else None
    return out
