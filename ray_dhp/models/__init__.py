"""Model families: specs (plans as data), loading and building."""

from __future__ import annotations

import functools
import os

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.internvl import SPEC as INTERNVL
from ray_dhp.models.qwen2_5_omni import SPEC as QWEN2_5_OMNI
from ray_dhp.models.qwen2_5_vl import SPEC as QWEN2_5_VL
from ray_dhp.models.qwen2_vl import SPEC as QWEN2_VL
from ray_dhp.models.qwen3_5 import SPEC as QWEN3_5
from ray_dhp.models.qwen3_5_moe import SPEC as QWEN3_5_MOE
from ray_dhp.models.qwen3_omni_moe import SPEC as QWEN3_OMNI_MOE
from ray_dhp.models.qwen3_vl import SPEC as QWEN3_VL
from ray_dhp.models.qwen3_vl_moe import SPEC as QWEN3_VL_MOE

FAMILIES = {s.name: s for s in (QWEN2_VL, QWEN2_5_VL, QWEN3_VL, QWEN3_VL_MOE, QWEN3_5,
                                        QWEN3_5_MOE, QWEN2_5_OMNI, QWEN3_OMNI_MOE, INTERNVL)}
_BY_MODEL_TYPE = {s.model_type: s for s in FAMILIES.values()}

__all__ = ["FAMILIES", "FamilySpec", "family_of", "load_model_config", "build_model"]


def encoder_operations(name: str):
    """The `EncoderSpec` operations module of encoder ``name`` (the same for every family that
    has such an encoder: "vision" is `ray_dhp.models.vision_encoder`, "audio" the Qwen-Omni
    thinkers' tower)."""
    ops = {e.ops for s in FAMILIES.values() for e in s.encoder_specs if e.name == name}
    if len(ops) != 1:
        raise KeyError(f"no single encoder module named {name!r}: {sorted(ops)}")
    import importlib

    return importlib.import_module(ops.pop())


@functools.lru_cache(maxsize=None)
def _vision_model_types() -> dict:
    """``{vision config model_type: family}`` of the hand-written families (their default
    configs, built offline)."""
    from transformers import AutoConfig

    return {getattr(AutoConfig.for_model(s.model_type), "vision_config").model_type: s
            for s in FAMILIES.values()}


def _vision_family(vision_config):
    """The hand-written family whose vision config ``vision_config`` is, or None."""
    return _vision_model_types().get(getattr(vision_config, "model_type", None))


def vision_norm(vision_config) -> str:
    """The norm kind of the tower of ``vision_config`` (`FamilySpec.vision_norm` of the family
    whose vision config it is; "layer_norm" for any other tower)."""
    family = _vision_family(vision_config)
    return family.vision_norm if family is not None else "layer_norm"


def vision_rotary(vision_config) -> bool:
    """Whether the tower of ``vision_config`` rotates q and k: `FamilySpec.vision_rotary` of the
    family whose vision config it is; for any other tower, whether its config names rotary
    parameters (CLIP / SigLIP towers add learned absolute positions and name none)."""
    family = _vision_family(vision_config)
    if family is not None:
        return family.vision_rotary
    return any(getattr(vision_config, k, None) is not None
               for k in ("rope_theta", "rope_parameters", "rope_scaling"))


def vision_fused_qkv(vision_config) -> bool:
    """Whether the tower of ``vision_config`` projects q, k and v with one linear:
    `FamilySpec.vision_fused_qkv` of the family whose vision config it is; any other tower is
    taken to have them apart (transformers' CLIP, SigLIP, Pixtral towers)."""
    family = _vision_family(vision_config)
    return family.vision_fused_qkv if family is not None else False


def vision_once_split(vision_config) -> bool:
    """Whether the tower of ``vision_config`` splits its once-per-token parts (patch embedding,
    merger) over vision SP ranks: the hand-written towers do; a generic family's tower
    (`ray_dhp.models.vision_generic_sp`) runs them whole on every SP rank, only its layers split."""
    return _vision_family(vision_config) is not None


def vision_saved_per_token(config, dtype_bytes: int):
    """``(layers, rest)`` bytes per patch token a generic family's vision side saves for backward
    at ``dtype_bytes`` per element, measured from its own code on the meta device
    (`ray_dhp.models.vision_saved`: ``layers`` inside the encoder's layers, which vision SP
    divides; ``rest`` whole on every SP rank); None for a hand-written family (its block formula
    holds) or where the meta probe cannot run."""
    family = _generic(config)
    if family is None:
        return None
    from ray_dhp.models.vision_saved import vision_saved_per_token as measured

    return measured(config, family, dtype_bytes)


def text_saved_per_token(config, dtype_bytes: int, tokens: int = 64):
    """``((replicated, sharded), ...)`` bytes per token each decoder layer of a generic family's
    language model saves for backward at ``dtype_bytes`` per element in rows of ``tokens``
    tokens, measured from its own code on the meta device (`ray_dhp.models.text_saved`: split as
    its text TP plan shards them);
    None for a hand-written family (its formula holds) or where the meta probe cannot run."""
    family = _generic(config)
    if family is None:
        return None
    from ray_dhp.models.text_saved import text_saved_per_token as measured

    return measured(config, family, dtype_bytes, tokens)


def _generic(config):
    """``config``'s `GenericFamily`, or None (a hand-written family, or none at all)."""
    from ray_dhp.models.generic import GenericFamily

    try:
        family = family_of(config)
    except ValueError:
        return None
    return family if isinstance(family, GenericFamily) else None


def load_model_config(model):
    """A transformers config from a config object or a local model directory."""
    if isinstance(model, (str, os.PathLike)):
        from transformers import AutoConfig

        return AutoConfig.from_pretrained(os.fspath(model), local_files_only=True)
    return model


def family_of(config) -> FamilySpec:
    """The family of ``config``: a hand-written one (`FAMILIES`) where there is one, else the
    generic family read from the model's own metadata (`ray_dhp.models.generic`)."""
    mt = getattr(config, "model_type", None)
    if mt in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[mt]
    from ray_dhp.models.generic import UnsupportedModel, generic_family

    try:
        return generic_family(config)
    except UnsupportedModel as e:
        raise ValueError(f"model_type {mt!r} is not supported: {e}. Families with their own "
                         f"file: {sorted(_BY_MODEL_TYPE)}.") from None


def fp64_experts(config, dtype) -> bool:
    """True for a mixture-of-experts config in fp64 that names no experts implementation: the
    default (``grouped_mm``) has no fp64 kernel, the per-expert loop (``eager``) is the one that
    runs (a directory's config.json does not store the choice; `demo.tiny_model_config` sets it)."""
    import torch

    from ray_dhp.models.generic_moe import expert_count

    text = getattr(config, "text_config", config)
    return (dtype == torch.float64 and expert_count(text) > 0
            and getattr(config, "_experts_implementation", None) in (None, "grouped_mm"))


def build_model(model, *, seed: int = 0, dtype=None):
    """The full transformers model, fp32 by default: random init from ``seed`` (config) or
    ``from_pretrained`` (local directory). This is the single-process reference's model
    (`ray_dhp.step.reference`); the engine never builds it whole: it builds on the meta device and
    materialises only its shards, with the same values (`ray_dhp.models.loading`)."""
    import torch
    import transformers

    config = load_model_config(model)
    cls = getattr(transformers, family_of(config).model_class)
    if isinstance(model, (str, os.PathLike)):
        extra = {"experts_implementation": "eager"} if fp64_experts(config, dtype) else {}
        m = cls.from_pretrained(os.fspath(model), local_files_only=True, dtype=dtype or torch.float32,
                                **extra)
    else:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            m = cls._from_config(config, dtype=dtype or torch.float32)
    return m
