"""Qwen2.5-VL: window-attention ViT (Ulysses only in `fullatt_block_indexes`), Qwen2 LM."""

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan

SPEC = FamilySpec(
    name="qwen2_5_vl",
    model_type="qwen2_5_vl",
    model_class="Qwen2_5_VLForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
    vision_norm="rms_norm",  # its tower's RMSNorm upcasts to fp32
)
