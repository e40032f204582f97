"""Published dims of the generic LLaVA-line families (``llava``, ``llava_onevision``,
``llava_next``, ``llava_next_video``, ``video_llava``, ``llava_onevision1_5``), merged into
`ray_dhp.cli.presets_generic`'s ``GENERIC_PRESETS``.

Sources, by family:

- ``llava`` 1.5-7b/13b: ``llava-hf/llava-1.5-{7b,13b}-hf`` (CLIP ViT-L/14 at 336 px + Vicuna).
- ``llava_onevision`` 7b: ``llava-hf/llava-onevision-qwen2-7b-ov-hf`` as transformers'
  ``convert_llava_onevision_weights_to_hf.py`` builds it: its SigLIP tower (26 layers: the last
  one dropped) is ``LlavaOnevisionConfig``'s vision default; its LM is ``Qwen/Qwen2-7B-Instruct``
  (that checkpoint's ``Qwen2Config`` as printed in public notes, e.g. the ``Retruth/deontic``
  repository: 28 layers, width 3584, 28 heads / 4 KV heads, FFN 18944, 152,064 rows, untied)
  with the script's two added tokens padded to a multiple of 64: 152,128 rows.
- ``llava_next`` 1.6-mistral-7b: ``llava-hf/llava-v1.6-mistral-7b-hf`` as transformers'
  ``convert_llava_next_weights_to_hf.py`` builds it: ``LlavaNextConfig``'s CLIP ViT-L/14 336-px
  tower and the text config of ``mistralai/Mistral-7B-Instruct-v0.2`` (Mistral 7B: 32 layers,
  width 4096, 32 heads / 8 KV heads, FFN 14336, 32,000 rows, untied; transformers'
  ``MistralConfig`` defaults, with 32,768 positions and rope theta 1e6), the script's two added
  tokens padded to a multiple of 64: 32,064 rows.
- ``llava_next_video`` 7b: ``llava-hf/LLaVA-NeXT-Video-7B-hf`` as transformers'
  ``convert_llava_next_video_weights_to_hf.py`` builds it from ``lmms-lab/LLaVA-NeXT-Video-7B``:
  the same CLIP tower and ``lmsys/vicuna-7b-v1.5`` (Llama 2 7B: 32 layers, width 4096, 32 heads,
  FFN 11008, 4,096 positions; transformers' ``LlamaConfig`` defaults) with the script's linear
  RoPE scaling of factor 2 and three added tokens padded to 64: 32,064 rows.
- ``video_llava`` 7b: ``LanguageBind/Video-LLaVA-7B-hf`` as transformers'
  ``convert_video_llava_weights_to_hf.py`` builds it: ``VideoLlavaConfig``'s two CLIP ViT-L/14
  towers at 224 px (image and video: 256 patches a frame) and ``lmsys/vicuna-7b-v1.5`` with three
  added tokens padded to 64: 32,064 rows.
- ``llava_onevision1_5`` 4b: ``lmms-lab/LLaVA-OneVision-1.5-4B-Instruct``: its RICE-ViT is
  transformers' ``LlavaOnevision1_5VisionConfig`` default (docstring checkpoint that model: 24
  layers, width 1024, 16 heads, FFN 4096, 14-px patch rows, 2x2 merged; also LoongForge's
  ``llava_vit.yaml``), its LM the text config defaults of the project's own remote code
  (``LLaVAOneVision1_5_TextConfig`` in the LLaVA-OneVision-1.5 repository, with ``RiceConfig``'s
  ``text_hidden_size`` 2560): Qwen3-4B's shape (36 layers, width 2560, 32 heads / 8 KV heads of
  128, FFN 9728, 151,936 rows) with an untied head, as transformers' composite default too.

Only the fields that shape parameters, parallel degrees and memory are listed (token ids
included so a config built from them is complete).
"""

from __future__ import annotations

_CLIP_L_336 = {  # CLIP ViT-L/14 at 336 px: 576 patches per image
    "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
    "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
    "projection_dim": 768,
}


def _llava_1_5(hidden: int, layers: int, heads: int, intermediate: int) -> dict:
    return {
        "model_type": "llava",
        "vision_config": dict(_CLIP_L_336),
        "text_config": {
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": heads, "vocab_size": 32064, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
        },
        "image_token_index": 32000, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
    }


def _llava_onevision_7b() -> dict:
    return {  # the vision tower is LlavaOnevisionConfig's default (SigLIP so400m at 384 px, 26 layers)
        "model_type": "llava_onevision",
        "text_config": {
            "model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
            "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
            "vocab_size": 152128, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
        },
        "image_token_index": 151646, "video_token_index": 151647, "tie_word_embeddings": False,
    }


def _llava_next_mistral_7b() -> dict:
    return {  # the CLIP ViT-L/14 336-px tower is LlavaNextConfig's default; AnyRes tiles of 336 px
        "model_type": "llava_next",
        "vision_config": dict(_CLIP_L_336),
        "text_config": {
            "model_type": "mistral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 32064, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "sliding_window": None, "tie_word_embeddings": False,
        },
        "image_token_index": 32000, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    }


_VICUNA_7B_V1_5 = {  # Llama 2 7B, 3 added tokens padded to 64 rows
    "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
    "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
}


def _llava_next_video_7b() -> dict:
    return {
        "model_type": "llava_next_video",
        "vision_config": dict(_CLIP_L_336),
        "text_config": {**_VICUNA_7B_V1_5, "rope_parameters": {
            "rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}},
        "video_token_index": 32000, "image_token_index": 32001, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    }


def _video_llava_7b() -> dict:
    return {  # one CLIP ViT-L/14 at 224 px for images and one for the 8 frames of a video
        "model_type": "video_llava",
        "vision_config": {**_CLIP_L_336, "image_size": 224},
        "text_config": dict(_VICUNA_7B_V1_5),
        "image_token_index": 32000, "video_token_index": 32001, "vision_feature_layer": -2,
        "vision_feature_select_strategy": "default", "tie_word_embeddings": False,
    }


def _llava_onevision1_5_4b() -> dict:
    return {
        "model_type": "llava_onevision1_5",
        "vision_config": {  # RICE-ViT on 14-px patch rows, 2x2 merged to the LM width
            "depth": 24, "hidden_size": 1024, "intermediate_size": 4096, "num_heads": 16,
            "patch_size": 14, "spatial_merge_size": 2, "out_hidden_size": 2560,
        },
        "text_config": {  # Qwen3-4B's shape, head untied
            "model_type": "qwen3", "hidden_size": 2560, "intermediate_size": 9728,
            "num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 262144,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
        },
        "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
        "vision_end_token_id": 151653, "tie_word_embeddings": False,
    }


LLAVA_PRESETS = {
    "llava": {
        "1.5-7b": _llava_1_5(4096, 32, 32, 11008),
        "1.5-13b": _llava_1_5(5120, 40, 40, 13824),
    },
    "llava_onevision": {"7b": _llava_onevision_7b()},
    "llava_next": {"1.6-mistral-7b": _llava_next_mistral_7b()},
    "llava_next_video": {"7b": _llava_next_video_7b()},
    "video_llava": {"7b": _video_llava_7b()},
    "llava_onevision1_5": {"4b": _llava_onevision1_5_4b()},
}
