"""Which transformers multimodal models ray_dhp trains, read from the installed transformers.

A *seam model* is a model type whose image-text-to-text class's ``forward`` takes
``mm_encoder_outputs`` (the seam the engine hands encoder features through). For each,
`survey` says how ray_dhp takes it: ``hand-written`` (a family file in `ray_dhp.models`),
``generic`` (`ray_dhp.models.generic` builds its family from the model's own metadata at the
type's default dims, or — where transformers' default config is not a consistent model — at
the tiny dims of `ray_dhp.models.shrink.tiny_config`), or ``refused`` with the reason the driver
gives (at the tiny dims).

    python -m ray_dhp.models.survey            # the markdown table (docs/supported_models.md)
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

__all__ = ["Status", "seam_model_types", "survey", "markdown", "with_vision"]


@dataclass(frozen=True)
class Status:
    model_type: str
    model_class: str
    kind: str          # "hand-written" | "generic" | "refused"
    detail: str        # the family's covered layouts, or the reason it is refused


def seam_model_types() -> list[tuple[str, str]]:
    """``(model_type, class name)`` of every seam model type, sorted."""
    import inspect

    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    out = []
    for model_type in sorted(CONFIG_MAPPING_NAMES):
        try:
            from transformers import AutoConfig

            config_cls = type(AutoConfig.for_model(model_type))
            cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[config_cls]
        except Exception:  # noqa: BLE001 - not an image-text-to-text type, or not importable
            continue
        if "mm_encoder_outputs" in inspect.signature(cls.forward).parameters:
            out.append((model_type, cls.__name__))
    return out


def with_vision(config):
    """``config``, or where its class makes the vision sub-config optional and the default
    leaves it out (Gemma 4's), a copy with the sub-config's defaults: the model type's
    vision-language variant is what the table is about."""
    sub = getattr(type(config), "sub_configs", {}).get("vision_config")
    if getattr(config, "vision_config", 0) is not None or sub is None:
        return config
    return type(config).from_dict({**config.to_dict(), "vision_config": sub().to_dict()})


def _first_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return text if len(text) <= 240 else text[:237] + "..."


def survey() -> list[Status]:
    """The `Status` of every seam model type at its default dims (no weights, no memory)."""
    from transformers import AutoConfig

    from ray_dhp.models import _BY_MODEL_TYPE
    from ray_dhp.models.generic import GenericFamily, UnsupportedModel, generic_family
    from ray_dhp.models.shrink import tiny_config

    import sys

    out = []
    types = seam_model_types()
    for k, (model_type, cls_name) in enumerate(types):
        print(f"[survey] {k + 1}/{len(types)} {model_type}", file=sys.stderr, flush=True)
        if model_type in _BY_MODEL_TYPE:
            out.append(Status(model_type, cls_name, "hand-written", _BY_MODEL_TYPE[model_type].name))
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                family: GenericFamily = generic_family(with_vision(AutoConfig.for_model(model_type)))
            where = ""
        except Exception as e:  # noqa: BLE001 - whatever the driver would raise is the reason
            # transformers' default config is sometimes not a consistent model (Gemma 3's
            # 224-px tower with 256 tokens per image): the same type at the tiny dims
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    family = generic_family(tiny_config(with_vision(AutoConfig.for_model(model_type))))
                where = f" (at tiny dims; transformers' default config: {_first_line(e)})"
            except Exception as e2:  # noqa: BLE001
                # the driver's own refusal at the published dims says why; the retry's error
                # (often shrinking a config the family cannot read anyway) only where it has none
                why = e if isinstance(e, UnsupportedModel) else e2
                out.append(Status(model_type, cls_name, "refused", _first_line(why)))
                continue
        tp = ("text TP " + ("refused: " + family.text_plan_refusal if family.text_plan_refusal
                            else "from base_model_tp_plan"))
        if not family.text_plan_refusal:  # Megatron text SP (`ray_dhp.models.text_sp_plans`)
            tp += "; text SP " + ("refused: " + family.text_sp_refusal if family.text_sp_refusal
                                  else "from the plan's regions")
        m = family.merge_size(None)
        images = ("patch rows + grid" if family.grid_input else
                  f"padded patch rows per image + "
                  f"{'image_position_ids' if 'image_position_ids' in family.image_kwargs else 'spatial_shapes'}"
                  f", a row per {m}x{m} patches"
                  if family.padded_input else
                  f"one NaViT strip + target_sizes, a row per {m}x{m} patches"
                  if family.packed_input else
                  "anyres tiles + image_sizes, rows per image from its original size"
                  if family.tiled_input else f"{family.rows_per_image} rows per image")
        vision = ("vision Ulysses SP + DP" if not family.vision_sp_refusal
                  else f"vision DP (SP refused: {family.vision_sp_refusal})")
        out.append(Status(model_type, cls_name, "generic",
                          f"{vision} ({images}); {tp}; text ZeRO 1-3{_moe(family)}{where}"))
    return out


def _moe(family) -> str:
    """A mixture-of-experts LM's part of the row (`ray_dhp.models.generic_moe`)."""
    moe = family.moe
    if moe is None:
        return ""
    loss = "router loss as the stock forward's" if moe.aux_loss else "no router loss (none in the stock forward)"
    ep = f"EP refused: {moe.ep_refusal}" if moe.ep_refusal else "expert parallelism"
    fixed = family.fixed_params  # `GenericFamily.fixed_params`: held frozen, as the stock model
    held = (f"; {len(fixed)} LM parameters the stock model never steps held frozen (not trained: "
            f"`{fixed[-1]}`, ...)" if fixed else "")
    return f"; mixture of experts: {loss}, {ep}{held}"


def markdown(rows: list[Status], verified: dict) -> str:
    """The table of ``rows``; ``verified``: model_type -> what the parity tests run for it."""
    counts = {k: sum(r.kind == k for r in rows) for k in ("hand-written", "generic", "refused")}
    lines = [f"{len(rows)} seam model types in the installed transformers: "
             f"{counts['hand-written']} hand-written, {counts['generic']} generic, "
             f"{counts['refused']} refused.", "",
             "| `model_type` | class | ray_dhp | what is covered, or why refused | verified (fp64 vs the stock model) |",
             "|---|---|---|---|---|"]
    for r in rows:
        detail = r.detail.replace("|", "\\|")
        lines.append(f"| `{r.model_type}` | `{r.model_class}` | {r.kind} | {detail} | "
                     f"{verified.get(r.model_type, '–')} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(markdown(survey(), {}), end="")
