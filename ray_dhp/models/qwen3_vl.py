"""Qwen3-VL: ViT with learned position embeddings and deepstack mergers; Qwen3 LM.

The LM's per-head ``q_norm``/``k_norm`` weights are shared by all heads; under TP each rank sees
only its heads, so their gradients are partial sums that must be all-reduced over the TP group
(the loss is right without it, the gradients are silently wrong).
"""

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan

SPEC = FamilySpec(
    name="qwen3_vl",
    model_type="qwen3_vl",
    model_class="Qwen3VLForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
    tp_partial_grad_suffixes=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    num_deepstack=lambda config: len(config.vision_config.deepstack_visual_indexes),
)
