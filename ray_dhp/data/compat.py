"""Does the processor fit the model? Checked in the driver, before any worker starts.

A processor from another model trains nothing useful and fails late (a shape error in the ViT, a
flood of bad samples, a missing special token), so `check_processor_fits` compares, naming the
file and field of each side:

* the image processor is there (``preprocessor_config.json``) when the model has a vision tower,
  and its ``patch_size``, ``temporal_patch_size`` and ``merge_size`` equal the vision config's
  ``patch_size``, ``temporal_patch_size`` and ``spatial_merge_size``;
* the tokenizer's ids of the format's image/video pads and vision start/end tokens equal the
  config's ``image_token_id``, ``video_token_id``, ``vision_start_token_id``,
  ``vision_end_token_id`` (`PromptFormat.config_ids`);
* every token id the tokenizer can produce is a row of the embedding (``vocab_size``);
* the special tokens the chat template writes (``<|...|>``) are tokens of the tokenizer.

`check_run_processor` is what ``ray-dhp plan``/``config``/``train`` and `DisaggregatedTrainer`
call (one load per directory and process); it returns the notes the driver prints before
training (no chat template: ray_dhp's own format renders the prompts).
"""

from __future__ import annotations

import os
import re

from ray_dhp.config.checks import ConfigError

__all__ = ["check_processor_fits", "check_run_processor", "processor_notes"]

_GEOMETRY = (("patch_size", "patch_size"), ("temporal_patch_size", "temporal_patch_size"),
             ("merge_size", "spatial_merge_size"))
_CACHE: dict = {}


def _config_value(config, name):
    """``(value, field)`` of a token-id / vocab field: top level, else the text sub-config."""
    if getattr(config, name, None) is not None:
        return getattr(config, name), name
    text = getattr(config, "text_config", None)
    if getattr(text, name, None) is not None:
        return getattr(text, name), f"text_config.{name}"
    return None, name


def _same_size(a, b) -> bool:
    """Equal geometry, a square written either way: a family's vision config may keep
    ``patch_size`` as ``(14, 14)`` where its image processor says ``14``."""
    def sides(v):
        return tuple(v) if isinstance(v, (list, tuple)) else None

    sa, sb = sides(a), sides(b)
    if sa is None and sb is not None:
        return all(x == a for x in sb)
    if sb is None and sa is not None:
        return all(x == b for x in sa)
    return (sa or a) == (sb or b)


_ANYRES = ("{}: the model of {} tiles each image anyres (image_grid_pinpoints: its feature rows "
           "per image depend on the image's original size), but this processor gives no tiles "
           "with image_sizes; use the model's own transformers processor.")


def check_processor_fits(processor, config, *, processor_at: str, model_at: str) -> None:
    """ConfigError naming both sides' file and field for the first way ``processor`` (a
    `VLProcessor`) does not fit the model ``config``. ``processor_at`` / ``model_at`` say where
    each comes from (e.g. ``"processor.path=/models/x"``, ``"model.path=/models/y"``)."""
    model_file = f"{model_at} (config.json)"
    vision = getattr(config, "vision_config", None)
    ip = processor.image_processor
    if vision is not None and ip is None:
        raise ConfigError(f"{processor_at}: no image processor (preprocessor_config.json is "
                          f"missing) but the model of {model_file} has a vision tower; copy the "
                          "model's preprocessor_config.json there.")
    for ours, theirs in _GEOMETRY if vision is not None else ():
        got, want = getattr(ip, ours, None), getattr(vision, theirs, None)
        if got is not None and want is not None and not _same_size(got, want):
            raise ConfigError(f"{processor_at}: preprocessor_config.json {ours}={got} but "
                              f"{model_file} vision_config.{theirs}={want}; the processor belongs "
                              "to another model.")
    tok = processor.tokenizer
    if "image" in processor.ids:  # the model's own processor (`ray_dhp.data.model_processor`)
        _check_model_processor(processor, config, processor_at, model_file)
    elif getattr(config, "image_grid_pinpoints", None) is not None:
        raise ConfigError(_ANYRES.format(processor_at, model_file))
    for key, field in processor.format.config_ids:  # the family's (`PromptFormat.config_ids`)
        want, where = _config_value(config, field)
        if key not in processor.ids:
            continue
        got, token = processor.ids[key], processor.format.token(key)
        if want is not None and got != want:
            raise ConfigError(f"{processor_at}: the tokenizer gives {token} the id {got} but "
                              f"{model_file} {where}={want}; the tokenizer belongs to another "
                              "model.")
    vocab, where = _config_value(config, "vocab_size")
    if vocab is not None and len(tok) > vocab:
        raise ConfigError(f"{processor_at}: the tokenizer has {len(tok)} tokens (ids up to "
                          f"{len(tok) - 1}) but {model_file} {where}={vocab} embedding rows; the "
                          "tokenizer belongs to another model.")
    template = processor.renderer.chat_template
    for token in sorted(set(re.findall(r"<\|[A-Za-z0-9_]+\|>", template or ""))):
        tid = tok.convert_tokens_to_ids(token)
        if tid is None or tid == tok.unk_token_id:
            source = os.path.basename(processor.chat_source or "") or "the chat template"
            raise ConfigError(f"{processor_at}: the chat template ({source}) writes {token}, "
                              "which is not a token of the tokenizer.")


def processor_notes(processor, processor_at: str) -> list:
    """What the driver says before training about the prompts: no chat template."""
    if processor.uses_chat_template:
        return []
    return [f"ray_dhp: {processor_at} has no chat template (none of chat_template.jinja, "
            "chat_template.json, processor_config.json or tokenizer_config.json holds one); the "
            "prompts are rendered in ray_dhp's own format of the family's turn markup, without a "
            "default system prompt."]


def _fingerprint(path: str) -> tuple:
    try:
        return tuple(sorted((e.name, e.stat().st_mtime_ns, e.stat().st_size)
                            for e in os.scandir(path) if e.is_file()))
    except OSError:
        return ()


def check_run_processor(dhp_config, *, processor_key: str = "DHPConfig(processor=...)",
                        model_key: str = "DHPConfig(model=...)") -> list:
    """Load the run's processor in the driver (``dhp_config.processor``, else the model
    directory's; nothing to check for a model given as a config without a processor) and
    `check_processor_fits` it against the model; returns `processor_notes`. Each directory is
    loaded once per process (while its files are unchanged)."""
    from ray_dhp.data.model_processor import run_processor
    from ray_dhp.data.processing import VLProcessor
    from ray_dhp.data.processor_dir import ProcessorDirError

    spec = dhp_config.processor
    if spec is None and isinstance(dhp_config.model, str) and os.path.isdir(dhp_config.model):
        spec, processor_key = dhp_config.model, f"{model_key} (its processor)"
    if spec is None:
        return []
    at = f"{processor_key}={spec}" if isinstance(spec, str) else processor_key
    model_at = (f"{model_key}={dhp_config.model}" if isinstance(dhp_config.model, str)
                else model_key)
    key = (spec, _fingerprint(spec)) if isinstance(spec, str) else None
    try:
        processor = _CACHE[key] if key in _CACHE else run_processor(spec, dhp_config.model)
    except (ProcessorDirError, ValueError) as e:
        raise ConfigError(f"{at}: {e}") from None
    if key is not None:
        _CACHE[key] = processor
    if isinstance(processor, VLProcessor):
        check_processor_fits(processor, dhp_config.model_config(), processor_at=at,
                             model_at=model_at)
    return processor_notes(processor, at)


def _check_model_processor(processor, config, processor_at: str, model_file: str) -> None:
    """The model's own processor: its image tokens hold the config's ``image_token_id``, and
    one image's placeholder becomes as many of them as the tower makes feature rows."""
    from PIL import Image

    want, where = _config_value(config, "image_token_id")
    if want is None:
        want, where = _config_value(config, "image_token_index")
    if want is not None and want not in processor.ids["image"]:
        raise ConfigError(f"{processor_at}: the processor's image tokens have the ids "
                          f"{list(processor.ids['image'])} but {model_file} {where}={want}; the "
                          "processor belongs to another model.")
    image = Image.new("RGB", (64, 48))
    pixels, grid, reps, per_image = processor.encode_images([image])
    tiled = processor.image_processor(images=[image], return_tensors="pt").get("image_grid_thw") is None
    if getattr(config, "image_grid_pinpoints", None) is not None and not per_image:
        raise ConfigError(_ANYRES.format(processor_at, model_file))
    rows = int(per_image["item_rows"][0]) if per_image else \
        int(grid.prod(-1)[0]) // processor.merge_size ** 2  # anyres: the processor's count
    size = getattr(getattr(config, "vision_config", None), "image_size", None)
    side = int(grid[0, -1]) * processor.patch_size
    whole = size // processor.patch_size * processor.patch_size if isinstance(size, int) else None
    if tiled and whole is not None and side != whole:  # (a tile's whole patches: `_tiled`)
        raise ConfigError(f"{processor_at}: the image processor makes {side}-px images but "
                          f"{model_file} vision_config.image_size={size}; the processor belongs "
                          "to another model.")
    ids = processor.tokenizer(reps[0], add_special_tokens=False)["input_ids"]
    got = sum(1 for i in ids if i in processor.ids["image"])
    if got != rows:
        raise ConfigError(f"{processor_at}: one image becomes {got} image tokens in the prompt "
                          f"but its {tuple(grid[0].tolist())} patch grid makes {rows} feature "
                          f"rows for the model of {model_file}; the processor belongs to "
                          "another model (or another image size).")
