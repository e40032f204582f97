"""The per-module training choices (`ray_dhp.config.tuning`) applied to a model's parameters.
Parameters are assigned to a module by their name in the transformers model:
``model.visual.merger.*`` and Qwen3-VL's ``model.visual.deepstack_merger_list.*`` are the merger,
the rest of ``model.visual.*`` the vision tower, ``model.audio_tower.*`` the audio encoder
(`FamilySpec.encoders`), everything else (``model.language_model.*``, ``lm_head.*``) the
language model.

A frozen parameter has ``requires_grad=False``: no gradient, no optimizer state, no fp32 master;
gradient reduction, clipping and ZeRO-1 skip it (the single-process reference,
`ray_dhp.step.reference`, freezes and groups parameters on its own, so parity checks these).
It is still held (the forward needs it) and saved in checkpoints, so a checkpoint resumes
exactly and exports a full model.
"""

from __future__ import annotations

import functools

from ray_dhp.config.tuning import Tuning
from ray_dhp.models import FAMILIES

MERGER_PREFIXES = ("model.visual.merger.", "model.visual.deepstack_merger_list.")


def module_of(name: str) -> str:
    """"vision", "merger", an encoder's name ("audio") or "llm" for a parameter's full name in
    the transformers model (the prefixes of every family's vision parts and projector:
    `vision_name_prefixes`; of its other encoders: `FamilySpec.encoders`)."""
    for prefix, encoder in encoder_name_prefixes():
        if name.startswith(prefix):
            return encoder
    vision, merger = vision_name_prefixes()
    if name.startswith(merger):
        return "merger"
    if name.startswith(vision):
        return "vision"
    return "llm"


@functools.lru_cache(maxsize=None)
def vision_name_prefixes() -> tuple:
    """(vision-side prefixes, projector prefixes) of full parameter names, over all families
    (`FamilySpec.vision_parts` / ``merger_prefixes``; ``MERGER_PREFIXES``: the Qwen ones)."""
    vision = {f"model.{p}." for s in FAMILIES.values() for p in s.vision_parts}
    merger = set(MERGER_PREFIXES) | {m for s in FAMILIES.values() for m in s.merger_prefixes}
    return tuple(sorted(vision)), tuple(sorted(merger))


@functools.lru_cache(maxsize=None)
def encoder_name_prefixes() -> tuple:
    """((full-name prefix, encoder name), ...) of every family's encoders besides vision."""
    return tuple(sorted({(e.prefix, e.name) for s in FAMILIES.values() for e in s.encoders}))


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name



def trains(tuning: Tuning, name: str) -> bool:
    """Does the parameter ``name`` (full transformers name) train under ``tuning``?"""
    module = module_of(name)
    if module == "llm" and tuning.lora is not None:
        return is_lora_param(name)
    return tuning.choice(module).train


def hyper(tuning: Tuning, name: str, lr: float, weight_decay: float) -> tuple:
    """(lr, weight decay) of the parameter ``name`` (decay before the norms/biases rule)."""
    c = tuning.choice(module_of(name))
    return (lr if c.lr is None else c.lr,
            weight_decay if c.weight_decay is None else c.weight_decay)


# -- applying ----------------------------------------------------------------------------------

def freeze(module, tuning: Tuning, prefix: str = "") -> None:
    """``requires_grad`` of every parameter of ``module`` (named ``prefix + name`` in the full
    model): whether it trains under ``tuning``."""
    for name, p in module.named_parameters():  # both ways: PEFT's injection freezes the rest
        p.requires_grad_(trains(tuning, prefix + name))


def apply_tuning(modules: dict, tuning: Tuning, unhosted: tuple = ()) -> tuple:
    """Freeze what does not train in the engine's shards. ``modules``: ``{(module name, full-
    name prefix of its parameters): module or None}`` (the encoders this rank hosts, e.g.
    ``("vision", "model.visual.")``, and ``("text", "")``: the model without them);
    ``unhosted``: parameter-name prefixes held frozen because the stock model never gives them
    a gradient either: encoders the layout gives no group of their own, which the text shard
    keeps (records with their modality are refused) and parameters a forward never reads
    (`EncoderSpec.unused`). Returns (``{module name: trainable params}``,
    frozen params)."""
    params, frozen = {}, []
    for (name, prefix), module in modules.items():
        if module is None:
            continue
        freeze(module, tuning, prefix)
        params[name] = []
        for n, p in module.named_parameters():
            if p.requires_grad and (prefix + n).startswith(unhosted):
                p.requires_grad_(False)
            (params[name] if p.requires_grad else frozen).append(p)
    return params, frozen

