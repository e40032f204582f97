"""Qwen2.5-Omni's thinker: a Qwen2.5-VL windowed ViT (Ulysses only in
``fullatt_block_indexes``), the Qwen2 LM under TP, and a Whisper-style audio tower.

Through today's two-module engine the vision tower and the LM train exactly as Qwen2.5-VL's
(images and video enter the thinker through ``mm_encoder_outputs``); the audio tower
(``model.audio_tower``) stays on the text ranks untouched, with no gradient: records with audio
are refused before training (`ray_dhp.data.audio.refuse_audio`) until the engine hosts the audio
encoder as a module of its own (issue #33).
"""

from ray_dhp.models.base import FamilySpec, sequence_parallel_text_plan, standard_text_plan

SPEC = FamilySpec(
    name="qwen2_5_omni",
    model_type="qwen2_5_omni_thinker",
    model_class="Qwen2_5OmniThinkerForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
    packing=False,
    packing_reason="its get_rope_index takes other arguments than the Qwen-VL ones that packing "
                   "computes each sample's positions with",
    audio=True,
)
