"""Qwen3-Omni's thinker: Qwen3-VL's ViT (deepstack, learned position table; its deepstack
mergers named ``merger_list``), Qwen3-VL-MoE's language model (per-head q/k norms, sparse blocks
of fused experts under a top-k router, the router's load-balancing loss) and a chunked-conv audio
tower.

Three modules, as Qwen2.5-Omni's (`ray_dhp.models.qwen2_5_omni`): the vision tower and the LM
train as Qwen3-VL-MoE's (images and video enter the thinker through ``mm_encoder_outputs``, with
their deepstack rows); the audio tower (``model.audio_tower``) is the encoder module ``audio``
(`ray_dhp.models.audio_omni`: the same collated clips, the tower of this config's own class),
in its own group when the layout gives it one. Its forward cuts each clip into chunks of
``2 * n_window`` feature frames, runs the three stride-2 convs per chunk (13 rows per whole
chunk) and attends inside windows of ``n_window_infer / (2 n_window)`` chunks' rows; every
chunk and window lies inside one clip, so a replica running some of a micro-batch's clips makes
exactly their rows of the whole batch's forward. (The window length is read from the batch's
longest chunk, which is a whole chunk whenever any clip spans one; a batch of shorter clips has
windows longer than each of them: the same attention either way.)

The rows of a clip are counted by transformers' own rule (`audio_tokens`, what the stock
processor pads a clip with and ``get_rope_index`` positions). Packed rows take each sample's
positions from the thinker's own ``get_rope_index`` (Qwen2.5-Omni's signature, so its adapter
`ray_dhp.models.qwen2_5_omni.packed_rope_index`: the clips' lengths included; video frames at
fractional times, seconds per temporal patch x ``position_id_per_seconds``, kept unrounded as
the stock forward keeps them); audio and deepstack rows fill the packed placeholders in sample
order, and the router loss counts the packed rows' real tokens (`ray_dhp.models.moe`). Text
sequence parallelism is refused (no plan for this family yet).
"""

from ray_dhp.models.base import EncoderSpec, FamilySpec, MoESpec
from ray_dhp.models.prompt_format import QWEN3_OMNI
from ray_dhp.models.qwen2_5_omni import packed_rope_index
from ray_dhp.models.qwen3_vl_moe import sparse_layers, text_tp_plan


def audio_tokens(frames):
    """Audio pads of a clip of ``frames`` feature columns (int or tensor): transformers'
    ``_get_feat_extract_output_lengths`` at the released ``n_window`` (50), as the stock
    processor counts them."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths)

    return _get_feat_extract_output_lengths(frames)


SPEC = FamilySpec(
    name="qwen3_omni_moe",
    model_type="qwen3_omni_moe_thinker",
    model_class="Qwen3OmniMoeThinkerForConditionalGeneration",
    text_tp_plan=text_tp_plan,
    text_sp_plan=None,
    tp_partial_grad_suffixes=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    num_deepstack=lambda config: len(config.vision_config.deepstack_visual_indexes),
    moe=MoESpec(router_suffix="mlp.gate", experts_suffix="mlp.experts", sparse_layers=sparse_layers),
    rope_index_adapter=packed_rope_index,  # its own get_rope_index (Qwen2.5-Omni's signature)
    video_seconds_key="video_second_per_grid",
    merger_prefixes=("model.visual.merger.", "model.visual.merger_list."),
    encoders=(EncoderSpec("audio", parts=("audio_tower",), ops="ray_dhp.models.audio_omni"),),
    prompt_format=QWEN3_OMNI,
)
