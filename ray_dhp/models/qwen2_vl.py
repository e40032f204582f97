"""Qwen2-VL: full-attention ViT (Ulysses in every block), Qwen2 LM."""

from ray_dhp.models.base import FamilySpec
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan

SPEC = FamilySpec(
    name="qwen2_vl",
    model_type="qwen2_vl",
    model_class="Qwen2VLForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
)
