"""InternVL (InternVL3 / InternVL3.5, transformers ``internvl``): InternViT, a full-attention ViT
with a CLS token and an absolute position table on fixed tiles (448 px, patch 14), pixel shuffle
(``downsample_ratio`` 0.5: 2x2 patches per feature row) and an MLP projector; a Qwen2 (InternVL3)
or Qwen3 (InternVL3.5) language model with 1-D RoPE.

* Vision: Ulysses SP over the tiles (`ray_dhp.models.vision_internvl`: one attention segment
  per tile, no windows, no rotary); the vision side is ``model.vision_tower`` plus
  ``model.multi_modal_projector`` (the projector is the "merger" of ``modules:``).
* Text: the Qwen2/Qwen3 plan (`standard_text_plan`; the LM sits at ``model.language_model`` as
  in the Qwen-VL families); Qwen3's per-head ``q_norm``/``k_norm`` get partial gradients (absent
  from a Qwen2 LM: the suffixes then match nothing). Text SP: `sequence_parallel_text_plan`
  (1-D RoPE cos/sin and the mask are built on the full sequence before the layers, as M-RoPE's).
* LoRA: the default targets (``q/k/v/o_proj``, ``gate/up/down_proj`` of the LM's layers).
* Packing: the LM's positions are 1-D RoPE, restarting at 0 in every packed sample
  (``packed_positions="1d"``: ``position_ids`` ``[R, L]``, no ``get_rope_index``), from which
  transformers builds the block-diagonal causal mask as for the Qwen-VL families.
"""

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan
from ray_dhp.models.vision_internvl import merge_size

SPEC = FamilySpec(
    name="internvl",
    model_type="internvl",
    model_class="InternVLForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
    tp_partial_grad_suffixes=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    packed_positions="1d",
    vision_module="ray_dhp.models.vision_internvl",
    vision_parts=("vision_tower", "multi_modal_projector"),
    merger_prefixes=("model.multi_modal_projector.",),
    merge_size=merge_size,
    vision_heads=lambda vision_config: vision_config.num_attention_heads,
    vision_depth=lambda vision_config: vision_config.num_hidden_layers,
    projector_dim=lambda config: config.text_config.hidden_size,  # the projector's linear_2
    pooled_tuple=False,
    vision_zero3=False,  # models/fsdp_vision.py units the Qwen towers' sub-modules only
    vision_rotary=False,  # InternViT adds learned absolute positions
)
