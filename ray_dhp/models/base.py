"""What the engine needs to know about a VLM family, as data.

A family file (``qwen2_vl.py``, ``qwen2_5_vl.py``, ``qwen3_vl.py``) builds one `FamilySpec`: its
transformers class, the tensor-parallel plan of its language model (module path -> ParallelStyle,
applied with ``parallelize_module``), which parameters get partial gradients under TP, and how its
vision features are handed to the language model. Mechanisms stay in ``ray_dhp.parallel``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ray_dhp.models.layer_config import layer_values
from ray_dhp.models.prompt_format import DEFAULT_PROMPT_FORMAT, PromptFormat


@dataclass(frozen=True)
class MoESpec:
    """A mixture-of-experts language model's seams: module-name suffixes (under a decoder
    layer) of the router, whose forward returns ``(router_logits, scores, indices)``, and of the
    fused experts (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``); ``sparse_layers``:
    (text_config) -> indices of the layers with a sparse MLP. Config keys are transformers'
    (``num_experts`` — or ``experts_key`` —, ``num_experts_per_tok``, ``router_aux_loss_coef``).
    ``router_output``: the index of the logits in the router's output; ``aux_loss``: the stock
    forward adds the load-balancing loss; ``ep_refusal``: why expert parallelism (and experts
    sharded over TP) is not covered ("": covered; `ray_dhp.models.generic_moe`)."""
    router_suffix: str
    experts_suffix: str
    sparse_layers: Callable
    router_output: int = 0
    experts_key: str = "num_experts"
    aux_loss: bool = True
    ep_refusal: str = ""


@dataclass(frozen=True)
class EncoderSpec:
    """An encoder module, as data: the vision side (`FamilySpec.vision_encoder`, from the family's
    vision fields) or a further one (Qwen2.5-Omni's audio tower, `FamilySpec.encoders`). ``name``:
    the module's config section and ``modules:`` key; ``parts``: the attributes of ``model.model``
    that make it; ``ops``: the module (import path) of its operations, the same for every encoder
    (``family``: the `FamilySpec`, ``config``: the model config; `ray_dhp.models.vision_encoder`,
    `ray_dhp.models.audio_omni`):

    * ``has_input(sample)``, ``rows(family, config, sample)`` (rows it hands the LM),
      ``cost(sample, model)`` (balancing; ``model``: the run's `CostModel`), ``dim(family, config)``;
    * ``plan(family, config, samples, sp, micro_batch=)``: a replica's shard plan over its ``sp``
      inner ranks (None: no input; ``micro_batch``: every sample of the micro-batch, for a
      forward that must pad as the stock model pads the whole batch); ``local_rows(plan, sp_rank, rows)``: an inner rank's rows, in its order;
    * ``inputs(samples)`` (host tensors by name), ``forward(family, module, inputs, plan, dtype,
      sp_rank=, sp_group=, comm=, sharded=)`` (``sharded``: its ZeRO-3 sharding, run instead);
    * ``install_slot(family, model)``: take it out of a text shard; ``text_inputs(family, config,
      model, samples, feats, device)``: the forward arguments that hand the text shard the rows;
    * ``SEQUENCE_PARALLEL``: ``sp > 1`` covered; ``zero3_refusal(family)``: why ZeRO-3 is not
      (None: ``shard(family, module, mesh, reduce_dtype, dtype, device)`` builds it)."""

    name: str
    parts: tuple
    ops: str
    # parameter names (under `prefix`) the stock forward never reads (Qwen2.5-Omni's
    # ``audio_bos_eos_token``): no gradient in the stock model, so AdamW never steps them;
    # the engine holds them frozen, which is the same
    unused: tuple = ()
    # the ``modules:`` entries (`ray_dhp.config.tuning`) its parameters belong to (empty: its name)
    tuned_as: tuple = ()

    def operations(self):
        import importlib

        return importlib.import_module(self.ops)

    @property
    def prefix(self) -> str:
        """Full-model name prefix of `module`'s parameter names."""
        return f"model.{self.parts[0]}." if len(self.parts) == 1 else "model."

    @property
    def tuning_modules(self) -> tuple:
        return self.tuned_as or (self.name,)

    def module(self, model) -> torch.nn.Module:
        """The encoder in ``model``: ``model.model.<part>`` for one part; several parts are held
        by one `EncoderParts` container (their parameter names ``<part>.<name>``)."""
        parts = [getattr(model.model, p) for p in self.parts]
        if len(parts) == 1:
            return parts[0]
        return EncoderParts(dict(zip(self.parts, parts)))

    def part_modules(self, model) -> dict:
        """``{full-model prefix: module}`` of each part (what the encoder's ranks keep)."""
        return {f"model.{p}.": getattr(model.model, p) for p in self.parts}


@dataclass(frozen=True)
class FamilySpec:
    name: str                      # "qwen2_5_vl"
    model_type: str                # transformers config.model_type
    model_class: str               # attribute of the transformers package
    text_tp_plan: Callable         # (text_config) -> {module path: ParallelStyle}, relative to the model root
    # Parameter-name suffixes whose gradients are partial sums over TP ranks (per-head norms that
    # see only the local heads): all-reduced over the TP group before the optimizer.
    tp_partial_grad_suffixes: tuple = ()
    num_deepstack: Callable = lambda config: 0  # extra feature chunks handed to the LM
    # (text_config) -> the TP plan with Megatron sequence parallelism; None: not covered (the
    # driver then refuses text sequence_parallel=true for this family).
    text_sp_plan: Optional[Callable] = None
    # (text_config) -> extra ((what, size), ...) the text TP degree must divide (e.g. the heads of
    # a second kind of mixer); the attention heads, KV heads, MLP width and vocabulary always.
    tp_divisors: Callable = lambda text_config: ()
    packing: bool = True  # False: samples cannot share a row (see packing_reason)
    packing_reason: str = "packed rows are not covered for it"
    # Token mixers of the LM that carry state along the sequence (a causal conv, a recurrence),
    # as `models.segments.StatefulMixer`s (chunk-aligned packed rows, the recurrence reset per
    # sample) or (suffix, output) pairs (one row per sample): `ray_dhp.models.segments`.
    stateful_mixers: tuple = ()
    # The LM's attention is plain causal inside a sample (no bidirectional image blocks), so a
    # packed row may run it one sample at a time (`ray_dhp.models.segment_attention`, which also
    # reads windows from the config); False keeps transformers' block mask over the whole row.
    segment_attention: bool = True
    # (text_config) -> ((module-name suffix, `ray_dhp.parallel.context_mixers.MixerHeads`), ...):
    # how those mixers split by head under text.context_parallel (empty: CP refused for them)
    cp_mixers: Callable = lambda text_config: ()
    # The positions of a packed sample: "mrope" (the model's ``model.model.get_rope_index`` of
    # the sample alone, Qwen-VL's 3-axis M-RoPE) or "1d" (0..n-1 per sample, a 1-D RoPE LM)
    packed_positions: str = "mrope"
    # (model) -> the ``rope_index`` packing calls, with the Qwen-VL signature (`rope_index`), for
    # a family whose ``get_rope_index`` takes other arguments (Qwen2.5-Omni's: grids, a mask,
    # the audio clips' lengths); None: ``model.model.get_rope_index`` itself
    rope_index_adapter: Optional[Callable] = None
    # Encoder modules besides the vision side (`EncoderSpec`), e.g. Qwen2.5-Omni's audio tower;
    # each trains as a module of its own when the layout gives it a group (``audio:``).
    encoders: tuple = ()
    # The LM's token mixers other than softmax attention (`ray-dhp plan`'s activations):
    # (text_config) -> how many layers have one; (text_config, rows, row_tokens, tp, dtype
    # bytes) -> the bytes one such layer saves for backward on a TP rank, in place of
    # attention's (`ray_dhp.planning.memory_layers`); None: every layer is attention
    text_mixer_layers: Callable = lambda text_config: 0
    text_mixer_saved: Optional[Callable] = None
    moe: Optional[MoESpec] = None  # a mixture-of-experts language model (`ray_dhp.models.moe`)
    # the forward's keyword for the videos' seconds per temporal patch (collated as
    # ``second_per_grid_ts``; Qwen2.5-Omni's thinker calls it ``video_second_per_grid``)
    video_seconds_key: str = "second_per_grid_ts"
    # -- the vision side, as data --------------------------------------------------------------
    # The module (import path) that splits the tower over SP ranks: ``plan_for(name, config,
    # grid_thw, sp)``, ``vision_forward(name, visual, pixel_values, plan, sp_rank, sp_group,
    # comm)``, ``install_for(name, visual, sp)``; ``stock_pixels(config, pixel_values, grid)``
    # (optional) turns a sample's pixel rows into what the stock model's forward takes.
    vision_module: str = "ray_dhp.models.vision_qwen"
    # Attributes of ``model.model`` that make the vision side (tower + projector), and the
    # parameter-name prefixes (full model names) of its projector ("merger" in `modules:`).
    vision_parts: tuple = ("visual",)
    merger_prefixes: tuple = ("model.visual.merger.", "model.visual.deepstack_merger_list.")
    # (config) -> patches per side of one merged feature row; config: the model's or its
    # vision config (the Qwen towers keep it in the vision config).
    merge_size: Callable = lambda config: getattr(config, "vision_config", config).spatial_merge_size
    # (config) -> patches of one image when the tower takes images of one fixed size (0: any
    # size, rows from the image's own grid); `ray-dhp plan` sizes its default sample by it
    image_patches: Callable = lambda config: 0
    vision_heads: Callable = lambda vision_config: vision_config.num_heads
    vision_depth: Callable = lambda vision_config: vision_config.depth
    # the tower's norm kind, for the activation estimate of `ray-dhp plan`: "layer_norm" or
    # "rms_norm" (fp32 compute: keeps an fp32 copy of its input; `ray_dhp.planning.memory_vision`)
    vision_norm: str = "layer_norm"
    # whether the tower rotates q and k (rotary positions: two more ``h``-wide tensors saved per
    # block and the ``cos`` / ``sin`` tables), for the same estimate
    vision_rotary: bool = True
    vision_fused_qkv: bool = True  # one qkv linear (its 3h output saved), else q, k, v apart
    projector_dim: Optional[Callable] = None  # (config) -> width of a feature row, if not the tower's
    pooled_tuple: bool = True  # the seam's pooler_output: a tuple of row blocks, else one tensor
    vision_zero3: bool = True  # False: `ray_dhp.models.fsdp_vision` cannot unit this tower
    model_processor: bool = False  # True: the model's own transformers processor makes samples
    #                                (`ray_dhp.data.model_processor`); False: `prompt_format`'s
    # the prompts ray_dhp writes for it when its samples are ours (`ray_dhp.models.prompt_format`)
    prompt_format: PromptFormat = DEFAULT_PROMPT_FORMAT

    # -- model access (the seams of transformers' VLM classes) ---------------------------------

    @property
    def audio(self) -> bool:
        """Whether the model has an audio encoder."""
        return self.encoder_spec("audio") is not None

    @property
    def vision_encoder(self) -> EncoderSpec:
        """The vision side (tower + projector) as an encoder module, from the vision fields."""
        return EncoderSpec("vision", self.vision_parts, "ray_dhp.models.vision_encoder",
                           tuned_as=("vision", "merger"))

    @property
    def encoder_specs(self) -> tuple:
        """Every encoder module of the family, in module order: the vision side first."""
        return (self.vision_encoder, *self.encoders)

    def encoder_spec(self, name: str) -> Optional[EncoderSpec]:
        return next((e for e in self.encoder_specs if e.name == name), None)

    def _spec(self, name: str) -> EncoderSpec:
        spec = self.encoder_spec(name)
        if spec is None:
            raise KeyError(f"the {self.name} family has no {name!r} encoder")
        return spec

    def encoder_module(self, name: str, model) -> torch.nn.Module:
        """Encoder ``name``'s module in ``model`` (`EncoderSpec.module`)."""
        return self._spec(name).module(model)

    def encoder_prefix(self, name: str) -> str:
        """Full-model name prefix of encoder ``name``'s parameters."""
        return self._spec(name).prefix

    def encoder_dim(self, name: str, config) -> int:
        """Width of one row of encoder ``name`` as it crosses the boundary."""
        return self._spec(name).operations().dim(self, config)

    def drop_encoder(self, name: str, model) -> None:
        """Take encoder ``name`` out of ``model`` (a text shard): its operations'
        ``install_slot`` (the vision parts are detached, the audio tower replaced by its
        parameter-free slot)."""
        self._spec(name).operations().install_slot(self, model)

    def encoder_parts(self, name: str, model) -> dict:
        """``{full-model prefix: module}`` of encoder ``name`` (what its ranks keep)."""
        return self._spec(name).part_modules(model)

    def visual(self, model) -> torch.nn.Module:
        """The vision side of ``model`` (`EncoderSpec.module` of `vision_encoder`)."""
        return self.vision_encoder.module(model)

    @property
    def vision_prefix(self) -> str:
        """Full-model name prefix of the `visual` module's parameter names."""
        return self.vision_encoder.prefix

    def vision_ops(self):
        import importlib

        return importlib.import_module(self.vision_module)

    def plan_vision(self, config, grid_thw, sp: int, **items):
        """The SP split of one replica's images (`vision_module`'s ``plan_for``; ``items``: anyres)."""
        return self.vision_ops().plan_for(self.name, config, grid_thw, sp, **items)

    def vision_forward(self, visual, pixel_values, plan, sp_rank: int, sp_group, comm=None):
        return self.vision_ops().vision_forward(self.name, visual, pixel_values, plan, sp_rank,
                                                sp_group, comm=comm)

    def stock_inputs(self, config, kwargs: dict) -> dict:
        """The keyword arguments of one padded batch as the stock model's forward takes them."""
        convert = getattr(self.vision_ops(), "stock_pixels", None)
        if convert is not None and kwargs.get("pixel_values") is not None:
            kwargs = {**kwargs, "pixel_values": convert(config, kwargs["pixel_values"],
                                                        kwargs["image_grid_thw"])}
        return kwargs

    @staticmethod
    def language_model(model) -> torch.nn.Module:
        return model.model.language_model

    def vision_owner(self, model) -> torch.nn.Module:
        """The module whose attributes `vision_parts` are (``model.model``)."""
        return model.model

    def rope_index(self, model):
        """What `ray_dhp.data.collate.pack_text_batch` takes as ``rope_index`` for ``model``:
        its ``get_rope_index`` for M-RoPE families, None for 1-D positions (`packed_positions`)."""
        if self.packed_positions == "1d":
            return None
        if self.rope_index_adapter is not None:
            return self.rope_index_adapter(model)
        return model.model.get_rope_index

    def lm_inputs(self, config, kwargs: dict) -> dict:
        """The text forward's keyword arguments as this family's stock forward takes them (the
        hand-written families take them all; `ray_dhp.models.generic` filters and adds)."""
        return kwargs

    def feature_dim(self, config) -> int:
        """Width of one merged vision row as it crosses the boundary (deepstack concatenated)."""
        return self.vision_out_dim(config) * (1 + self.num_deepstack(config))

    def vision_out_dim(self, config) -> int:
        """Width of the merger output (Qwen2-VL calls it ``hidden_size``, later families
        ``out_hidden_size``; `projector_dim` where the family says)."""
        if self.projector_dim is not None:
            return self.projector_dim(config)
        vc = config.vision_config
        return getattr(vc, "out_hidden_size", None) or vc.hidden_size

    def encoder_outputs(self, config, feats: torch.Tensor, modalities=None) -> dict:
        """Wrap boundary features ``[rows, feature_dim]`` as the model's ``mm_encoder_outputs``;
        ``modalities`` (``[rows]``, 1 image / 2 video; None: all images) splits the rows into
        the image and the video outputs, each keeping the rows' order."""
        if modalities is None or bool((modalities == 1).all()):
            return {"image": self._wrap(config, feats)}
        modalities = modalities.to(feats.device)
        out = {}
        for kind, key in ((1, "image"), (2, "video")):
            rows = (modalities == kind).nonzero().flatten()
            if rows.numel():
                out[key] = self._wrap(config, feats.index_select(0, rows))
        return out

    def _wrap(self, config, feats: torch.Tensor):
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        if not self.pooled_tuple:
            return BaseModelOutputWithPooling(pooler_output=feats)
        n_deep = self.num_deepstack(config)
        if n_deep == 0:
            return BaseModelOutputWithPooling(pooler_output=(feats,))
        from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

        chunks = feats.chunk(1 + n_deep, dim=-1)
        return BaseModelOutputWithDeepstackFeatures(
            pooler_output=(chunks[0],), deepstack_features=[(c,) for c in chunks[1:]])

    # -- validation ----------------------------------------------------------------------------

    def validate_layout(self, config, *, sp: int, tp: int, text_sp: bool = False,
                        packing: bool = False) -> None:
        """Raise ValueError (saying what to change) if the degrees do not fit the model dims."""
        vc, tc = config.vision_config, config.text_config
        self.check_packing(packing)
        if text_sp and self.text_sp_plan is None:
            raise ValueError(f"text sequence_parallel=true is not covered for the {self.name} family; "
                             f"set text.sequence_parallel=false.")
        vh = self.vision_heads(vc)
        if vh % sp:
            raise ValueError(
                f"vision sequence_parallel={sp} must divide the vision attention heads ({vh}); "
                f"use one of {_divisors(vh)}."
            )
        dense_mlp = self.moe is None or len(self.moe.sparse_layers(tc)) < tc.num_hidden_layers
        for what, n in (("attention heads", tc.num_attention_heads),
                        *(("KV heads", kv) for kv in sorted(set(layer_values(tc, "num_key_value_heads")))),
                        ("MLP intermediate size", tc.intermediate_size if dense_mlp else tp),
                        ("vocabulary size", tc.vocab_size), *self.tp_divisors(tc)):
            if n % tp:
                raise ValueError(
                    f"text tensor_parallel={tp} must divide the language model's {what} ({n}); "
                    f"use one of {_divisors(n, limit=64)}."
                )
        _reject_dropout(config)


    def check_packing(self, packing: bool, key: str = "data.packing") -> None:
        """Raise ValueError naming ``key`` if packing is on for a family that cannot pack (the
        driver calls it with its own key name, before any worker starts)."""
        if packing and not self.packing:
            raise ValueError(f"{key}=true is not covered for the {self.name} family "
                             f"({self.packing_reason}); set {key}=false.")

    def validate_expert_parallel(self, config, ep: int) -> None:
        """Raise ValueError naming ``text.expert_parallel`` if ``ep`` does not fit the model."""
        if ep == 1:
            return
        if self.moe is None:
            raise ValueError(f"text.expert_parallel={ep}: the {self.name} family is a dense model "
                             "(no experts); set text.expert_parallel=1.")
        if self.moe.ep_refusal:
            raise ValueError(f"text.expert_parallel={ep} is not covered for {self.name!r}: "
                             f"{self.moe.ep_refusal}; set text.expert_parallel=1.")
        n = getattr(config.text_config, self.moe.experts_key)
        if n % ep:
            raise ValueError(f"text.expert_parallel={ep} must divide the number of experts ({n}); "
                             f"use one of {_divisors(n)}.")


class EncoderParts(torch.nn.Module):
    """Several sub-modules of a model that together are one encoder (e.g. InternVL's vision side:
    ``vision_tower`` and ``multi_modal_projector``), registered under their own attribute names
    (the same module objects: the container owns no parameters of its own)."""

    def __init__(self, parts: dict):
        super().__init__()
        for name, module in parts.items():
            self.add_module(name, module)


def _reject_dropout(config) -> None:
    """Dropout is refused: its masks would have to be drawn identically on ranks that replicate
    a computation (TP ranks, SP ranks of replicated weights) and independently where they shard
    it, which the engine does not arrange; a silently different mask per rank would break the
    equality with the single-process update. Qwen-VL models train with dropout 0."""
    for where, sub in (("", config), ("text_config.", config.text_config),
                       ("vision_config.", config.vision_config)):
        for key, value in sub.to_dict().items():
            if "dropout" in key and isinstance(value, (int, float)) and value > 0:
                raise ValueError(
                    f"model config {where}{key}={value}: dropout is not supported (ranks would "
                    f"draw different masks); set {where}{key}=0.0 in the model's config.json "
                    "(or model.config).")


def _divisors(n: int, limit: int = 1 << 30) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]
