"""A model's sizes from its config: its parameters counted on the meta device and classified
with the family's TP plan (`count_params`: what one TP rank of the text model holds, what each
ZeRO partition owns), the ViT's width. The planners (`ray_dhp.planning.memory`) and the engine's
cost balancer (`ray_dhp.step.microbatch.cost_model_of`) read them.
"""

from __future__ import annotations

import fnmatch
import functools
from dataclasses import dataclass

from ray_dhp.models import family_of
from ray_dhp.models.layer_config import layer_max, layer_values
from ray_dhp.models.tuning import trains as trains_under

AUDIO_PREFIX = "model.audio_tower."  # the thinker's audio encoder (`ray_dhp.planning.memory_audio`)


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one model: totals and what one TP rank of the text model holds."""

    vision: int
    text: int
    text_sharded: int  # part of ``text`` split over TP ranks
    vision_sizes: tuple = ()   # element count of every trained ViT parameter, in the model's order
    largest: int = 0           # element count of the largest single parameter (full, unsharded)
    # frozen parameters (`ray_dhp.config.tuning`): held, but no gradient, master or optimizer state
    vision_frozen: int = 0
    text_frozen: int = 0
    text_frozen_sharded: int = 0
    # `TextParam` of every text parameter, in the model's order (ZeRO partitions)
    text_sizes: tuple = ()
    # `TextParam` (never TP-sharded) of every ViT parameter, in the model's order (FSDP2 shares)
    vision_params: tuple = ()
    # the LM's attention normalises q and k per head (one ``head_dim`` weight each, Qwen3-style)
    text_head_norms: bool = False
    # RMSNorms per decoder layer of the LM (``hidden``-wide norm weights: 2 pre-norm, Gemma 3's 4)
    text_block_norms: int = 2
    # ZeRO-3's FSDP2 units in forward order (`ray_dhp.parallel.fsdp`), each the indices of its
    # parameters in ``text_sizes`` / ``vision_params``; the rest is the root's
    text_units: tuple = ()
    vision_units: tuple = ()

    def text_per_rank(self, tp: int) -> int:
        return self.text - self.text_sharded + self.text_sharded // tp

    def text_frozen_per_rank(self, tp: int) -> int:
        return self.text_frozen - self.text_frozen_sharded + self.text_frozen_sharded // tp

    def vision_updated_by(self, rank_in_group: int, group_size: int, stage: int) -> int:
        """ViT parameters vision rank ``rank_in_group`` updates (all of them at stage 0)."""
        if not stage or group_size == 1 or not self.vision_sizes:
            return self.vision - self.vision_frozen
        if stage == 3:
            return sum(q.fsdp_share(rank_in_group, group_size, 1) for q in self.vision_params if q.trained)
        return owned(list(self.vision_sizes), rank_in_group, group_size)

    def vision_held_by(self, rank_in_group: int, group_size: int, stage: int) -> int:
        """ViT parameters vision rank ``rank_in_group`` holds (its FSDP2 shards at stage 3)."""
        if stage != 3 or group_size == 1 or not self.vision_params:
            return self.vision
        return sum(q.fsdp_share(rank_in_group, group_size, 1) for q in self.vision_params)

    def text_updated_by(self, dp_index: int, dp: int, tp: int, stage: int) -> int:
        """Elements of the trained text parameters (local TP shards) text replica ``dp_index``
        updates (all of them at stage 0)."""
        trained = self.text_per_rank(tp) - self.text_frozen_per_rank(tp)
        if not stage or dp == 1 or not self.text_sizes:
            return trained
        if stage == 3:
            return sum(q.fsdp_share(dp_index, dp, tp) for q in self.text_sizes if q.trained)
        return owned([q.local(tp) for q in self.text_sizes if q.trained], dp_index, dp)

    def text_held_by(self, dp_index: int, dp: int, tp: int, stage: int) -> int:
        """Elements of the text parameters text replica ``dp_index`` holds (its FSDP shards at
        stage 3, else its whole TP shard)."""
        if stage != 3 or dp == 1 or not self.text_sizes:
            return self.text_per_rank(tp)
        return sum(q.fsdp_share(dp_index, dp, tp) for q in self.text_sizes)


@dataclass(frozen=True)
class TextParam:
    """One text parameter as the ZeRO partitions see it."""

    numel: int
    sharded: bool      # split over the TP ranks
    dim0: int          # its first dimension (FSDP2 shards the local TP shard along it)
    dim0_sharded: bool  # the TP split is along dim 0 (column-parallel, vocab-parallel embedding)
    trained: bool
    expert: bool = False  # a MoE experts tensor (partitioned over expert_parallel, own ZeRO partition)
    audio: bool = False   # part of the audio tower (`ray_dhp.planning.memory_audio.without_audio`)

    def local(self, tp: int) -> int:
        return self.numel // tp if self.sharded else self.numel

    def fsdp_share(self, index: int, dp: int, tp: int) -> int:
        """Elements of replica ``index``'s FSDP2 shard: ``torch.chunk`` rows along dim 0."""
        rows = self.dim0 // tp if self.dim0_sharded else self.dim0
        per = -(-rows // dp)
        mine = max(0, min(per, rows - index * per))
        return self.local(tp) // rows * mine if rows else 0


def owned(sizes: list, index: int, world: int) -> int:
    return _owner_loads(tuple(sizes), world)[0][index]


def owned_largest(sizes: list, index: int, world: int) -> int:
    """Elements of the largest tensor rank ``index`` of ``world`` owns (`owned`'s partition)."""
    return _owner_loads(tuple(sizes), world)[1][index]


@functools.lru_cache(maxsize=512)
def _owner_loads(sizes: tuple, world: int) -> tuple:
    """Elements each of ``world`` ranks owns under `ray_dhp.parallel.zero.owners`, and the largest
    tensor each owns (computed once per partition: the planner asks for every rank of every
    candidate layout)."""
    from ray_dhp.parallel.zero import owners

    loads, largest = [0] * world, [0] * world
    for n, o in zip(sizes, owners(list(sizes), world)):
        loads[o] += n
        largest[o] = max(largest[o], n)
    return tuple(loads), tuple(largest)


def count_params(config, tuning=None) -> ParamCounts:
    """Count parameters on the meta device and classify them with the family's TP plan; with a
    `ray_dhp.config.tuning.Tuning`, also count the frozen ones."""
    import torch
    import transformers
    family = family_of(config)
    # on the meta device: every tensor the classes make is meta, also those they fill eagerly
    # (Llama 4's ``torch.zeros`` of every layer's experts, 5 GiB a layer at Scout's dims, which
    # accelerate's init_empty_weights lets allocate before it moves them; its re-wrapping of
    # each parameter also copies a parameter's attributes into ``Parameter.__new__``, which
    # breaks under a TorchFunctionMode that tags tensors: `ray_dhp.parallel.devcheck`)
    with torch.device("meta"):
        model = getattr(transformers, family.model_class)._from_config(config, dtype=torch.float32)
    model.tie_weights()  # a tied weight (embedding = lm_head) is one parameter, counted once (as
    # `build_meta_model` holds it)
    plan = family.text_tp_plan(config.text_config)
    experts = set()
    if family.moe is not None:
        from ray_dhp.parallel.expert import expert_params

        experts = {id(p) for p in expert_params(model, family.moe)}
    if tuning is not None and tuning.lora is not None:  # PEFT adapters, sharded by their plan
        from ray_dhp.models.lora import counting_plan, inject

        inject(model, tuning.lora, seed=0)
        plan = counting_plan(plan, tuning.lora.target_modules)
    vision_names = {f"{family.vision_prefix}{n}" for n, _ in family.visual(model).named_parameters()}
    tuned = (lambda name: True) if tuning is None else functools.partial(trains_under, tuning)
    # parameters no forward reads (`EncoderSpec.unused`, e.g. a tower's layers past the feature
    # layer): the engine holds them frozen (`ray_dhp.models.tuning.apply_tuning`)
    unused = tuple(e.prefix + u for e in family.encoder_specs for u in e.unused)

    def trains(name: str) -> bool:
        return tuned(name) and not (unused and name.startswith(unused))
    vision = text = sharded = largest = v_frozen = t_frozen = t_frozen_sharded = 0
    text_sizes, vision_params = [], []
    sizes = tuple(p.numel() for n, p in family.visual(model).named_parameters()
                  if trains(f"{family.vision_prefix}{n}"))
    for name, p in model.named_parameters():
        largest = max(largest, p.numel())
        if name in vision_names:
            vision += p.numel()
            vision_params.append(TextParam(p.numel(), False, p.shape[0] if p.dim() else 1, False,
                                           trains(name)))
            v_frozen += 0 if trains(name) else p.numel()
            continue
        text += p.numel()
        t_frozen += 0 if trains(name) else p.numel()
        if _is_sharded(name, plan):
            sharded += p.numel()
            t_frozen_sharded += 0 if trains(name) else p.numel()
        text_sizes.append(TextParam(p.numel(), _is_sharded(name, plan), p.shape[0] if p.dim() else 1,
                                    _dim0_sharded(name, plan), trains(name), id(p) in experts,
                                    name.startswith(AUDIO_PREFIX)))
    return ParamCounts(vision=vision, text=text, text_sharded=sharded, vision_sizes=sizes,
                       largest=largest, vision_frozen=v_frozen, text_frozen=t_frozen,
                       text_frozen_sharded=t_frozen_sharded, text_sizes=tuple(text_sizes),
                       vision_params=tuple(vision_params),
                       text_head_norms=_head_norms(model, vision_names, config.text_config),
                       text_block_norms=_block_norms(model, vision_names, config.text_config),
                       **_fsdp_units(model, family, vision_names))


def _fsdp_units(model, family, vision_names: set) -> dict:
    """``text_units`` / ``vision_units`` of `ParamCounts`: the FSDP2 units the engine shards at
    ZeRO stage 3 (`ray_dhp.parallel.fsdp.text_units`, `ray_dhp.models.fsdp_vision.vision_units`),
    each as the indices of its parameters among the text / vision parameters."""
    from ray_dhp.models.fsdp_vision import vision_units
    from ray_dhp.parallel.fsdp import text_units

    order = {"text": {}, "vision": {}}
    for name, p in model.named_parameters():
        side = order["vision" if name in vision_names else "text"]
        side[id(p)] = len(side)

    def indices(units, side):
        return tuple(tuple(sorted({side[id(p)] for p in u.parameters() if id(p) in side}))
                     for u in units)
    try:
        vision = indices(vision_units(family.visual(model)), order["vision"])
    except (AttributeError, TypeError):  # a tower without children holding parameters
        vision = ()
    return {"text_units": indices(text_units(model, family), order["text"]),
            "vision_units": vision}


def _block_norms(model, vision_names: set, tc) -> int:
    """RMSNorms per decoder layer of the LM: its 1-D ``hidden_size`` weights of norm modules,
    less the final norm, over its layers (at least the two of a pre-norm block)."""
    found = [n for n, p in model.named_parameters() if n not in vision_names and p.dim() == 1
             and p.numel() == tc.hidden_size and "norm" in n.rsplit(".", 2)[-2]
             and not n.startswith(AUDIO_PREFIX)]
    return max(2, (len(found) - 1) // tc.num_hidden_layers)


def _head_norms(model, vision_names: set, tc) -> bool:
    """Whether the LM's attention layers hold per-head q/k norms: 1-D weights of ``head_dim``
    elements inside its attention modules (``*attn.*``), at least two (q and k)."""
    hd = layer_values(tc, "head_dim") if layer_max(tc, "head_dim") else [tc.hidden_size // tc.num_attention_heads]
    found = [n for n, p in model.named_parameters() if n not in vision_names and p.dim() == 1
             and p.numel() in hd and "attn." in n and not n.startswith(AUDIO_PREFIX)]
    return len(found) >= 2


_ROWWISE = ("RowwiseParallel", "OwnedRowwise")  # `ray_dhp.models.text_plans.OwnedRowwise`


def _dim0_sharded(param_name: str, plan: dict) -> bool:
    """The TP split of ``param_name`` is along its dim 0: column-parallel weights and biases, the
    vocab-parallel (row-parallel) embedding."""
    module, leaf = param_name.rsplit(".", 1)
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):
            kind = type(style).__name__
            return kind == "ColwiseParallel" or (kind in _ROWWISE and module.endswith("embed_tokens"))
    return False


def _is_sharded(param_name: str, plan: dict) -> bool:
    module, leaf = param_name.rsplit(".", 1)
    for pattern, style in plan.items():
        if fnmatch.fnmatchcase(module, pattern):  # a style may keep its module's own parameters whole
            if not getattr(style, "shards_parameters", True):
                return False
            return not (leaf == "bias" and type(style).__name__ in _ROWWISE)
    return False


def vision_width(vc) -> int:
    """The ViT's own width: ``embed_dim`` for Qwen2-VL (whose ``hidden_size`` is the LLM width the
    merger projects to), ``hidden_size`` for Qwen2.5-VL and Qwen3-VL."""
    return getattr(vc, "embed_dim", None) or vc.hidden_size
