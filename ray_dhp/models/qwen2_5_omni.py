"""Qwen2.5-Omni's thinker: a Qwen2.5-VL windowed ViT (Ulysses only in
``fullatt_block_indexes``), the Qwen2 LM under TP, and a Whisper-style audio tower.

Three modules: the vision tower and the LM train as Qwen2.5-VL's (images and video enter the
thinker through ``mm_encoder_outputs``); the audio tower (``model.audio_tower``) is the encoder
module ``audio`` (`ray_dhp.models.audio_omni`), with its own group when the layout gives it one
(``audio:``). Without an audio group the text ranks keep the tower, frozen, and records with
audio are refused before training (`ray_dhp.data.audio.refuse_audio`). Packed rows take each
sample's positions from the thinker's own ``get_rope_index`` (`packed_rope_index`: its clips'
lengths included), and its audio rows fill the placeholders of the packed rows in sample order.
"""

import torch

from ray_dhp.models.base import EncoderSpec, FamilySpec
from ray_dhp.models.text_plans import sequence_parallel_text_plan, standard_text_plan

SPEC = FamilySpec(
    name="qwen2_5_omni",
    model_type="qwen2_5_omni_thinker",
    model_class="Qwen2_5OmniThinkerForConditionalGeneration",
    text_tp_plan=lambda text_config: standard_text_plan(),
    text_sp_plan=lambda text_config: sequence_parallel_text_plan(),
    rope_index_adapter=lambda model: packed_rope_index(model),  # its own get_rope_index
    video_seconds_key="video_second_per_grid",
    vision_norm="rms_norm",  # Qwen2.5-VL's tower
    vision_fused_qkv=False,  # but q, k and v are projected apart
    encoders=(EncoderSpec("audio", parts=("audio_tower",), ops="ray_dhp.models.audio_omni",
                          unused=("audio_bos_eos_token.",)),),
)


def packed_rope_index(model):
    """The thinker's ``get_rope_index`` (Qwen2.5-Omni's, and Qwen3-Omni's of the same signature)
    behind the Qwen-VL signature packing calls it with
    (`ray_dhp.data.collate.pack_text_batch`, one sample at a time): the grids, an all-ones mask,
    the clips' frames (``audio_seqlens``: audio placeholders take positions after the text
    before them, as in the stock forward, whose ``feature_attention_mask`` gives the same
    lengths) and the videos' seconds per temporal patch; ``use_audio_in_video`` off, as in
    training."""
    rope = model.model.get_rope_index

    def rope_index(input_ids, mm_token_type_ids=None, image_grid_thw=None, video_grid_thw=None,
                   second_per_grid_ts=None, audio_seqlens=None):
        return rope(input_ids, image_grid_thw, video_grid_thw, torch.ones_like(input_ids),
                    use_audio_in_video=False, audio_seqlens=audio_seqlens,
                    second_per_grids=second_per_grid_ts)
    return rope_index


def audio_forward(audio_tower, input_features, feature_attention_mask):
    """``[tokens, output_dim]``: the audio tower on collated clips (`audio_inputs`:
    ``[clips, n_mels, frames]`` and the ``[clips, frames]`` mask), one row per audio pad of the
    clips in order — what the thinker's ``get_audio_features`` computes (the masked columns
    concatenated along time, per-clip lengths, and after the convs where the tower's forward
    takes them: Qwen2.5-Omni's ``aftercnn_lens``; Qwen3-Omni's tower computes its own), for the
    engine to run as a module of its own."""
    import inspect

    lengths = feature_attention_mask.sum(-1)
    flat = input_features.permute(0, 2, 1)[feature_attention_mask.bool()].permute(1, 0)
    extra = {}
    if "aftercnn_lens" in inspect.signature(type(audio_tower).forward).parameters:
        extra["aftercnn_lens"] = audio_tower._get_feat_extract_output_lengths(lengths)[0]
    flat = flat.to(next(audio_tower.parameters()).dtype)
    return audio_tower(flat, feature_lens=lengths, **extra).last_hidden_state


def audio_tokens(frames):
    """Audio pad tokens of a clip of ``frames`` feature columns (int or tensor): the Omni
    encoder's conv stride 2, then its pooling stride 2 (transformers'
    ``_get_feat_extract_output_lengths``)."""
    after_conv = (frames - 1) // 2 + 1
    return (after_conv - 2) // 2 + 1


def audio_inputs(samples) -> dict:
    """The model's audio inputs of the samples (`ray_dhp.data.sample.Sample`), clips in
    batch order: ``input_features`` ``[clips, n_mels, frames]`` (each clip's columns
    left-aligned, zeros after them) and ``feature_attention_mask`` ``[clips, frames]`` (1 on a
    clip's columns), ``frames`` the longest clip's; neither key without audio (the VL models'
    forwards do not take them), and only the mask where a sample comes without its features (a
    text rank: the loader routes them to the audio ranks only). The stock processor pads every
    clip to its extractor's whole window instead (other values after the mask); the model reads
    only the masked columns."""
    with_audio = [s for s in samples if s.audio_lengths is not None]
    lengths = [n for s in with_audio for n in s.audio_lengths.tolist()]
    if not lengths:
        return {}
    frames = max(lengths)
    mask = torch.zeros((len(lengths), frames), dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
    if any(s.audio_features is None for s in with_audio):
        return {"feature_attention_mask": mask}
    clips = [c for s in with_audio for c in s.audio_features.split(s.audio_lengths.tolist(), dim=1)]
    feats = clips[0].new_zeros((len(clips), clips[0].shape[0], frames))
    for i, c in enumerate(clips):
        feats[i, :, :c.shape[1]] = c
    return {"input_features": feats, "feature_attention_mask": mask}
