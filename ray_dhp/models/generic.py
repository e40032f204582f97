"""Any transformers vision-language model with the ``mm_encoder_outputs`` seam, read from the
model's own metadata: a `FamilySpec` built at run time, with nothing written for the family.

What is read, and from where:

* **The class**: the config's ``*ForConditionalGeneration`` in transformers' image-text-to-text
  auto mapping; its ``forward`` must name ``mm_encoder_outputs`` (the seam the text shard takes
  the features through, exactly as the stock forward takes them from ``get_image_features``).
* **The vision side**: every child of ``model.model`` besides the language model (e.g.
  ``vision_tower`` + ``multi_modal_projector``); a vision rank keeps a *shell* of the model's own
  inner class that holds only those children, so ``get_image_features`` — the model's own code —
  runs on it unchanged. The child whose module carries the vision config is the tower, the
  others are the projector ("merger" in ``modules:``).
* **Rows per image**: one ``get_image_features`` call on the meta device at the tower's
  ``image_size`` (no memory, no compute) gives the feature rows of one image; they must tile the
  ``image_size / patch_size`` patch grid as ``m x m`` squares (``m``: the merge size the data
  mechanisms count rows with). A model whose rows do not is refused, with the counts.
* **Text tensor parallelism**: the language model's ``base_model_tp_plan`` (``colwise`` /
  ``rowwise`` as DTensor's ``ColwiseParallel`` / ``RowwiseParallel``; ``colwise_gather_output``
  / ``rowwise_split_input`` — GLM's fused ``gate_up_proj``, chunked whole by the forward — as
  a column-parallel linear whose output is all-gathered and a row-parallel one that takes its
  slice of a replicated input; ``embedding_rowwise``: a vocabulary-parallel embedding;
  parameters marked ``replicated_with_grad_allreduce`` — per-head norms that see only the
  local heads — get their gradients summed over the TP group), plus ray_dhp's vocabulary-parallel embedding and
  ``lm_head`` (logits stay vocabulary-sharded for the parallel loss). A plan with any other
  style is refused for ``tensor_parallel > 1``, naming the style.
* **The forward's inputs**: only keywords its ``forward`` names are passed; a forward that
  takes ``token_type_ids`` (Gemma 3's bidirectional attention over an image's tokens) gets 1 on
  image tokens, as the family's processor writes them.

Covered today: towers on fixed-size images (one tile per image: ``image_size`` from the vision
config) and towers that take each image at its own size: patch rows with an ``image_grid_thw``
(GLM-4V's; Kimi-K2.5's as ``[N, C, P, P]`` patch images, its merge read from the probe's rows)
padded patch rows per image with their ``spatial_shapes`` or each patch's ``image_position_ids``
(`padded_inputs`: SigLIP 2's NaFlex, LFM2-VL's; Gemma 4's) or one NaViT strip with
``target_sizes`` (`packed_inputs`: MiniCPM-V's, as its image processor lays it out) or "anyres"
tiles with each image's original ``image_sizes`` (`anyres`: LLaVA-NeXT's, -OneVision's; the rows
per image the processor's count, the ``image_newline`` parameter a vision part,
`ray_dhp.models.generic_shell`), vision data parallelism, vision Ulysses sequence parallelism
where the tower's layers call attention through transformers' interface
(`ray_dhp.models.vision_generic_sp`; refused with the reason where they do not:
``vision_sp_refusal``), text TP, Megatron text
sequence parallelism where the plan and the decoder layers allow it
(`ray_dhp.models.text_sp_plans`), ZeRO 1-3 for the text side. Packing where it is exact
(`ray_dhp.models.generic_packing`). A mixture-of-experts language model: its router loss and
expert parallelism read from its own metadata (`ray_dhp.models.generic_moe`). Refused in the
driver, with the reason: text sequence parallelism where it cannot be derived, vision ZeRO-3;
and the whole model where it has an audio encoder, its text forward reads a vision part
(`text_reads_vision`); not covered yet. Language-model parameters the stock model never steps
are held frozen (`fixed_params`); a text forward that reads rows of its embedding table outside
the embedding (`text_reads_table`: Gemma 4's pad row) has them served row by row from a
vocabulary-parallel or ZeRO-3 table (`ray_dhp.parallel.table_rows`).

Example::

    from transformers import AutoConfig
    spec = family_of(AutoConfig.for_model("gemma3"))   # a GenericFamily, nothing written for it
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass

import torch

from ray_dhp.models.base import EncoderSpec, FamilySpec
from ray_dhp.models.generic_shell import ShellEncoder
from ray_dhp.models.contract import SEAM
from ray_dhp.models.generic_moe import _meta_lm, dense_plan, moe_spec, unreached
from ray_dhp.models.generic_packing import packed_rope_index, packing_rule
from ray_dhp.models.segments import SEGMENTS_KWARG
from ray_dhp.models.generic_probe import (LM_ATTRS, PADDED_SIDE, UnsupportedModel,  # noqa: F401 (re-exported)
                                          anyres, grid_geometry, grid_input,
                                          image_inputs, packed_grid, packed_input, packed_inputs,
                                          padded_input, padded_inputs, probe)
from ray_dhp.models.generic_reads import text_reads_table, text_reads_vision
from ray_dhp.models.text_plans import HF_STYLES, hf_text_plan
from ray_dhp.models.text_sp_plans import hf_sp_plan, sp_layout
from ray_dhp.models.vision_generic_sp import refusal as sp_refusal_of

__all__ = ["GenericFamily", "ShellEncoder", "generic_family", "seam_class", "UnsupportedModel"]

#: language-model attributes of ``model.model`` (in the order they are looked for)




def seam_class(config):
    """The transformers ``*ForConditionalGeneration`` class of ``config`` whose forward takes
    ``mm_encoder_outputs``, or raise `UnsupportedModel` saying why not."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    mt = getattr(config, "model_type", None)
    try:
        cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(config)]
    except KeyError:
        raise UnsupportedModel(f"model_type {mt!r}: transformers has no image-text-to-text model "
                               "class for this config") from None
    if SEAM not in inspect.signature(cls.forward).parameters:
        raise UnsupportedModel(f"model_type {mt!r}: {cls.__name__}.forward takes no {SEAM!r} "
                               "(the seam ray_dhp hands the encoder features through)")
    return cls


@dataclass(frozen=True)
class GenericFamily(FamilySpec):
    """A `FamilySpec` read from a transformers model (see the module docstring)."""

    lm_attr: str = "language_model"
    tower: str = "vision_tower"        # the child of ``model.model`` that is the vision tower
    rows_per_image: int = 0            # feature rows of one image at ``image_size``
    text_plan_refusal: str = ""        # why text TP > 1 is refused ("" when the plan translates)
    forward_params: tuple = ()         # the keywords the stock forward names
    image_kwargs: tuple = ()           # further get_image_features keywords (`image_inputs`)
    pixel_dims: int = 4                # 4: [n, C, H, W]; 5: [1, n, C, H, W]
    grid_input: bool = False           # the tower takes patch rows + image_grid_thw (GLM-4V's)
    padded_input: bool = False         # the tower takes padded rows per image + spatial_shapes
    packed_input: bool = False         # the tower takes one NaViT strip + target_sizes (MiniCPM-V)
    tiled_input: bool = False          # anyres tiles + each image's image_sizes (`anyres`)
    vision_unused: tuple = ()          # vision parameters no gradient reaches (names under model.)
    fixed_params: tuple = ()           # LM parameters the stock model never steps (below)
    pooled_dims: int = 2               # a pooled tensor's dims: 3 = [images, rows, d] (VideoLLaVA)
    root: str = "model"                # the module holding the parts: model.model, or "" (Llama 4)
    lm_path: str = ""                  # the decoder's path (embed_tokens, layers), if not model.<lm_attr>
    text_sp_refusal: str = ""          # why text SP is refused (`ray_dhp.models.text_sp_plans`)
    vision_sp_refusal: str = ""        # why vision SP > 1 is refused ("" when the tower splits)
    text_reads_table: str = ""         # where the text forward reads an embedding row (`ShardedRowReads`)
    packed_masks: bool = False         # packed rows' masks per sample (`ray_dhp.models.packed_masks`)

    # -- model access ---------------------------------------------------------------------------

    def language_model(self, model) -> torch.nn.Module:  # noqa: D102 - FamilySpec's
        return model.get_submodule(self.lm_path) if self.lm_path else getattr(model.model, self.lm_attr)

    def vision_owner(self, model) -> torch.nn.Module:  # noqa: D102 - FamilySpec's
        return model.get_submodule(self.root) if self.root else model

    @property
    def vision_encoder(self) -> EncoderSpec:
        """The vision side as a `ShellEncoder` (the parameters no gradient reaches held frozen).
        Its ``unused`` also names `fixed_params`, language-model parameters the stock model
        never steps: statistics its class makes with ``requires_grad=False`` (ERNIE-4.5-VL's
        ``e_score_correction_bias``) and, for a mixture-of-experts LM, those its text forward
        never reaches (`ray_dhp.models.generic_moe.unreached`: ERNIE's vision experts); the
        engine and the planner hold every name there frozen wherever it lives (the text shard)."""
        return ShellEncoder("vision", self.vision_parts, "ray_dhp.models.vision_encoder",
                            unused=self.vision_unused + self.fixed_params,
                            tuned_as=("vision", "merger"), root=self.root)

    def _wrap(self, config, feats: torch.Tensor):
        if self.pooled_dims == 3:  # the stock forward takes the rows image by image
            feats = feats.reshape(-1, self.rows_per_image, feats.shape[-1])
        return super()._wrap(config, feats)

    def lm_inputs(self, config, kwargs: dict) -> dict:
        """The keywords the stock forward names (others dropped) and ``use_cache`` (its
        ``**kwargs`` reach the LM: without it a cache is built, and the mask code then ignores
        packed positions) and packed rows' segments (`SEGMENTS_KWARG`, on to attention), plus ``token_type_ids`` (1 on image tokens) where the forward takes them
        and, for `packed_masks` on packed rows (no 2-D mask), each sample's own masks."""
        out = {k: v for k, v in kwargs.items()
               if k in self.forward_params or k in ("use_cache", SEGMENTS_KWARG)}
        if "token_type_ids" in self.forward_params and kwargs.get("mm_token_type_ids") is not None:
            out["token_type_ids"] = (kwargs["mm_token_type_ids"] == 1).long()
        if self.packed_masks and kwargs.get("attention_mask") is None \
                and kwargs.get("position_ids") is not None:  # packed rows: each sample's own masks
            import transformers

            from ray_dhp.models.packed_masks import packed_mask_mapping

            out["attention_mask"] = packed_mask_mapping(
                getattr(transformers, self.model_class), config, kwargs["position_ids"],
                token_type_ids=out.get("token_type_ids"))
        return out

    def rope_index(self, model):
        """The model's own ``get_rope_index`` called on a packed sample with the arguments its
        signature names, the grids as the stock forward takes them
        (`ray_dhp.models.generic_packing.packed_rope_index`); None for 1-D positions."""
        if self.packed_positions == "1d":
            return None
        return packed_rope_index(self.vision_owner(model).get_rope_index,
                                 packed_grid if self.packed_input else None)

    def stock_inputs(self, config, kwargs: dict) -> dict:
        kwargs = super().stock_inputs(config, kwargs)
        if kwargs.get("pixel_values") is not None and self.grid_input and self.pixel_dims == 4:
            vc = config.vision_config  # patch images [N, C, P, P] (Kimi-K2.5's tower)
            kwargs["pixel_values"] = kwargs["pixel_values"].reshape(
                -1, getattr(vc, "num_channels", 3), vc.patch_size, vc.patch_size)
        elif kwargs.get("pixel_values") is not None and self.packed_input:
            vc = config.vision_config
            kwargs.update(packed_inputs(kwargs["pixel_values"], kwargs["image_grid_thw"],
                                        vc.patch_size, getattr(vc, "num_channels", 3)))
        elif kwargs.get("pixel_values") is not None and self.padded_input:
            vc = config.vision_config
            kwargs.update(padded_inputs(self.image_kwargs, kwargs["pixel_values"],
                                        kwargs["image_grid_thw"], vc.patch_size,
                                        getattr(vc, "num_channels", 3)))
        elif kwargs.get("pixel_values") is not None and not self.grid_input:
            kwargs.update(image_inputs(self.image_kwargs, self.pixel_dims, kwargs["pixel_values"],
                                       kwargs.get("image_sizes") if self.tiled_input else None))
        return self.lm_inputs(config, kwargs)

    # -- validation -----------------------------------------------------------------------------

    def validate_layout(self, config, *, sp: int, tp: int, text_sp: bool = False,
                        packing: bool = False) -> None:
        if sp > 1 and self.vision_sp_refusal:
            raise ValueError(
                f"vision sequence_parallel={sp} is not covered for {self.model_type!r}: "
                f"{self.vision_sp_refusal}; use vision data_parallel instead.")
        if tp > 1 and self.text_plan_refusal:
            raise ValueError(f"text tensor_parallel={tp} is not covered for {self.model_type!r}: "
                             f"{self.text_plan_refusal}; use text data_parallel or ZeRO.")
        if text_sp and self.text_sp_refusal:
            raise ValueError(f"text sequence_parallel=true is not covered for {self.model_type!r}: "
                             f"{self.text_sp_refusal}; set text.sequence_parallel=false.")
        super().validate_layout(config, sp=sp, tp=tp, text_sp=text_sp, packing=packing)


def generic_family(config) -> GenericFamily:
    """The `GenericFamily` of ``config`` (raises `UnsupportedModel` with the reason); one per
    distinct config (cached)."""
    cls = seam_class(config)
    return _family(cls, config.to_json_string(use_diff=False))


@functools.lru_cache(maxsize=None)
def _family(cls, config_json: str) -> GenericFamily:
    import json

    config = cls.config_class.from_dict(json.loads(config_json))
    model_type = config.model_type
    vc = getattr(config, "vision_config", None)
    if vc is None:
        raise UnsupportedModel(f"model_type {model_type!r} has no vision_config")
    _check_covered(cls, config)
    grid = grid_input(cls, vc)
    padded = not grid and padded_input(cls)
    packed = not grid and not padded and packed_input(cls, config)
    tiled = not (grid or padded or packed) and anyres(config)
    pooled, inner, unused, (image_kwargs, pixel_dims), probed = probe(config, cls, grid, padded,
                                                                      packed, tiled)
    is_sequence = isinstance(pooled, (list, tuple))
    pooled_dims = 2 if is_sequence else pooled.dim()
    if is_sequence:
        pooled = torch.cat([p.reshape(-1, p.shape[-1]) for p in pooled])
    rows = int(pooled.reshape(-1, pooled.shape[-1]).shape[0])
    size = patch = 0  # a fixed image size's geometry (none with a grid: any size)
    if grid or padded or packed:  # any size: rows per m x m patches of the probe's square image
        _, _, m0, side = grid_geometry(vc) if grid else (0, 0, None, probed)
        m = math.isqrt(side * side // rows) if rows and (side * side) % rows == 0 else 0
        if not m or m * m * rows != side * side or side % m or m0 not in (None, m):
            raise UnsupportedModel(f"model_type {model_type!r}: {rows} feature rows for a "
                                   f"{side}x{side}-patch image do not tile it in squares"
                                   + (f" of {m0}x{m0} (its spatial_merge_size)" if m0 else ""))
    elif tiled:  # rows per image from its size (the processor counts them): patch rows, as its
        # own pack_image_features checks a base tile's rows against (image_size // patch_size)^2
        m = 1
    else:
        size, patch = _image_geometry(vc)
        side = probed // patch  # the probe's image: the tower's, or smaller on CPU
        m = math.isqrt(side * side // rows) if rows and (side * side) % rows == 0 else 0
        if not m or m * m * rows != side * side or side % m:
            raise UnsupportedModel(
                f"model_type {model_type!r}: {rows} feature rows per {probed}-px image do not tile "
                f"its {side}x{side} patch grid in squares (the generic family counts rows per "
                "patch square)")
    parts, lm_attr, tower = _parts(inner, model_type)
    reads = text_reads_vision(type(inner), parts)
    if reads:
        raise UnsupportedModel(f"model_type {model_type!r}: its text forward reads a vision part "
                               f"outside get_image_features ({reads}), which a text shard does not "
                               "hold: not covered by the generic family yet")
    sp_refusal = sp_refusal_of(getattr(inner, tower), vc)
    root, lm_path, head_path, decoder = _layout(cls, inner, lm_attr)
    top = f"{root}." if root else ""
    try:
        moe, experts = moe_spec(cls, config, type(decoder))
    except ValueError as e:
        raise UnsupportedModel(f"model_type {model_type!r}: {e}") from None
    import fnmatch

    never = unreached(config, type(decoder), experts) if moe is not None else ()
    fixed = tuple(f"{lm_path}.{n}"[len(top):] for n, p in
                  _meta_lm(type(decoder), config.get_text_config().to_json_string(use_diff=False))
                  .named_parameters()
                  if not p.requires_grad or any(fnmatch.fnmatchcase(n, k) for k in never))
    plan = _present(dense_plan(dict(getattr(config.get_text_config(), "base_model_tp_plan", None)
                                    or {}), experts), type(decoder), config)
    refusal = next((f"its base_model_tp_plan uses {style!r} ({key})" for key, style in plan.items()
                    if style not in HF_STYLES), "")
    partial = tuple(f"{key.split('*.')[-1]}.weight" for key, style in plan.items()
                    if style == "replicated_with_grad_allreduce")
    text_sp, text_sp_refusal = sp_layout(_meta_lm(type(decoder), config.get_text_config(
    ).to_json_string(use_diff=False)), plan, experts, config.get_text_config().hidden_size) \
        if not refusal else (None, f"text TP is refused ({refusal})")
    params = tuple(inspect.signature(cls.forward).parameters)
    return GenericFamily(
        name=model_type, model_type=model_type, model_class=cls.__name__,
        text_tp_plan=lambda text_config: hf_text_plan(plan, lm_path, text_config, head_path),
        text_sp_plan=None if text_sp is None else (
            lambda text_config: hf_sp_plan(text_sp, lm_path, text_config, head_path)),
        text_sp_refusal=text_sp_refusal,
        tp_partial_grad_suffixes=partial,
        **packing_rule(inner, decoder, config.get_text_config(), params, cls,
                       tuple(packed_grid(torch.zeros(0, 3))) if packed else ("image_grid_thw",)),
        vision_module="ray_dhp.models.vision_generic",
        vision_parts=parts,
        merger_prefixes=tuple(f"{top}{p}" + ("" if isinstance(getattr(inner, p), torch.nn.Parameter)
                                             else ".") for p in parts if p != tower),
        merge_size=lambda config, _m=m: _m,
        image_patches=lambda config, _n=(size // patch) ** 2 if size else 0: _n,
        vision_heads=lambda vision_config: vision_config.num_attention_heads,
        vision_depth=lambda vision_config: vision_config.num_hidden_layers,
        projector_dim=lambda config: config.get_text_config().hidden_size,
        pooled_tuple=is_sequence, pooled_dims=pooled_dims,
        vision_zero3=False,
        model_processor=True,
        vision_unused=unused, fixed_params=fixed, image_kwargs=image_kwargs, pixel_dims=pixel_dims, grid_input=grid,
        padded_input=padded, packed_input=packed, tiled_input=tiled,
        lm_attr=lm_attr, tower=tower, root=root, lm_path=lm_path,
        rows_per_image=0 if tiled else rows, text_plan_refusal=refusal,
        forward_params=params, moe=moe, vision_sp_refusal=sp_refusal,
        text_reads_table=text_reads_table(type(inner), lm_attr))


def _layout(cls, inner, lm_attr: str) -> tuple:
    """``(root, decoder path, head path, decoder)``: where ``inner`` (the probe's module holding
    the parts) sits in the model ("model", or "" where the model keeps the parts at its top), the
    decoder (``embed_tokens``, ``layers``): the language-model child itself, or its base model
    where the child is a ``*ForCausalLM`` with its own head (Llama 4's), and the output head."""
    root = "" if isinstance(inner, cls) else "model"
    lm = getattr(inner, lm_attr)
    decoder = getattr(lm, "base_model", lm)
    if decoder is lm and not isinstance(getattr(lm, "layers", None), torch.nn.ModuleList):
        # a base_model_prefix naming no child (Llama 4's ``language_model``): the child that
        # holds the decoder layers
        decoder = next((m for m in lm.children()
                        if isinstance(getattr(m, "layers", None), torch.nn.ModuleList)), lm)
    inner_path = lm_attr if decoder is lm else \
        f"{lm_attr}.{next(n for n, m in lm.named_children() if m is decoder)}"
    lm_path = f"{root}.{inner_path}" if root else inner_path
    head, head_path = inner.get_output_embeddings() if root == "" else None, "lm_head"
    if head is not None:
        head_path = next(n for n, m in inner.named_modules() if m is head)
    return root, lm_path, head_path, decoder


def _present(plan: dict, lm_cls, config) -> dict:
    """``plan`` less the entries that match no module of the language model (built on the meta
    device): a plan covers its family's variants (DeepSeek-V3's ``q_proj``, absent where the
    config gives queries a low-rank ``q_a_proj`` / ``q_b_proj``), as transformers skips them."""
    import fnmatch

    names = [n for n, _ in _meta_lm(lm_cls, config.get_text_config().to_json_string(use_diff=False))
             .named_modules()]
    return {k: v for k, v in plan.items() if any(fnmatch.fnmatchcase(n, k) for n in names)}


def _check_covered(cls, config) -> None:
    """Refuse what the generic family does not train exactly yet, saying why: an audio encoder
    (its parts would be taken for the vision side)."""
    mt = config.model_type
    if "pixel_values" not in inspect.signature(cls.forward).parameters:
        raise UnsupportedModel(f"model_type {mt!r}: {cls.__name__}.forward takes no pixel_values "
                               "(its images go by another name): the stock model the engine is "
                               "exact against could not be run")
    if hasattr(cls, "get_audio_features"):
        raise UnsupportedModel(f"model_type {mt!r} has an audio encoder, which the generic family "
                               "does not cover yet")


def _image_geometry(vc) -> tuple:
    size, patch = getattr(vc, "image_size", None), getattr(vc, "patch_size", None)
    if not isinstance(size, int) or not isinstance(patch, int) or size % patch:
        raise UnsupportedModel(f"vision config image_size={size!r}, patch_size={patch!r}: the "
                               "generic family covers towers on fixed square images")
    return size, patch


def _parts(inner, model_type: str) -> tuple:
    """``(vision parts, language-model attribute, tower part)`` of ``model.model``."""
    names = [n for n, _ in inner.named_children()]
    lm = next((a for a in LM_ATTRS if a in names), None)
    if lm is None:
        raise UnsupportedModel(f"model_type {model_type!r}: model.model has no language_model "
                               f"(children: {names})")
    parts = tuple(n for n in names if n != lm) + tuple(  # and parameters it holds itself
        n for n, _ in inner.named_parameters(recurse=False))  # (image_newline)
    vc = inner.config.vision_config
    tower = next((n for n in parts
                  if isinstance(getattr(getattr(inner, n), "config", None), type(vc))), parts[0])
    return parts, lm, tower
