"""Published model dimensions, usable without weights (``model: {family: ..., preset: ...}``).

`preset_dims` is the one entry point; this module holds the families with a file of their own
(``ray_dhp/models/``), `ray_dhp.cli.presets_generic` those the generic family runs (its sources
are listed there). The dimensions here are those of the public Hugging Face ``config.json`` files
of Qwen2.5-VL, Qwen2.5-Omni (its thinker, below), Qwen3.5 (9B: transformers' own
``Qwen3_5Config`` defaults, its "Qwen3.5-9B style configuration"; 27B: the released
``Qwen/Qwen3.5-27B`` text config), Qwen3.5-MoE, Qwen3-VL (dense, below), Qwen3-VL-MoE,
InternVL3 and InternVL3.5 (below) and Qwen3-Omni's thinker (below); only the fields that shape parameters, parallel degrees and memory are listed
(token ids included so a config built from them is complete). `ray-dhp plan` builds such a model
on the meta device to count parameters per rank; nothing is downloaded.
"""

from __future__ import annotations

import copy

from ray_dhp.cli.presets_generic import GENERIC_PRESETS

_QWEN2_5_VL_VISION = {
    "depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3456,
    "fullatt_block_indexes": [7, 15, 23, 31], "window_size": 112, "patch_size": 14,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 2, "in_chans": 3,
}
_QWEN2_5_VL_TOKENS = {
    "image_token_id": 151655, "video_token_id": 151656,
    "vision_start_token_id": 151652, "vision_end_token_id": 151653,
}


def _qwen2_5_vl(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
                tied: bool = False) -> dict:
    return {
        "model_type": "qwen2_5_vl",
        "vision_config": {**_QWEN2_5_VL_VISION, "out_hidden_size": hidden},
        "text_config": {
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "intermediate_size": intermediate,
            "vocab_size": 152064, "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0,
                                "mrope_section": [16, 24, 24]},
            "tie_word_embeddings": tied,
        },
        "tie_word_embeddings": tied,
        **_QWEN2_5_VL_TOKENS,
    }


_QWEN3_5_VISION = {
    "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2, "num_position_embeddings": 2304,
    "in_channels": 3,
}


def _qwen3_5(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int,
             linear_k_heads: int, linear_v_heads: int) -> dict:
    return {
        "model_type": "qwen3_5",
        "vision_config": {**_QWEN3_5_VISION, "out_hidden_size": hidden},
        "text_config": {
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": 256, "intermediate_size": intermediate,
            "vocab_size": 248320, "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
            "linear_num_key_heads": linear_k_heads, "linear_num_value_heads": linear_v_heads,
            "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
            "full_attention_interval": 4,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0,
                                "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                                "mrope_interleaved": True},
            "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False,
        "image_token_id": 248056, "video_token_id": 248057,
        "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    }


# Qwen3.5-MoE: Qwen3.5's ViT and hybrid LM (3 Gated DeltaNet layers per gated-attention layer,
# head_dim 256, 2 KV heads) with a sparse block in every layer: routed experts and one shared
# expert of the routed experts' width. Dims as torchtitan's ``qwen3_5`` flavors transcribe the
# released configs (35B-A3B, 122B-A10B, 397B-A17B), cross-checked for 35B-A3B against
# transformers' ``Qwen3_5MoeConfig`` defaults (its "Qwen3.5-35B-A3B style configuration") and
# slime's model scripts, for 397B-A17B against slime's (all but the linear-attention heads).
def _qwen3_5_moe(hidden: int, layers: int, heads: int, experts: int, top_k: int,
                 moe_intermediate: int, linear_v_heads: int) -> dict:
    out = _qwen3_5(hidden, layers, heads, 2, 0, 16, linear_v_heads)
    text = {k: v for k, v in out["text_config"].items() if k != "intermediate_size"}
    text.update({"moe_intermediate_size": moe_intermediate,
                 "shared_expert_intermediate_size": moe_intermediate, "num_experts": experts,
                 "num_experts_per_tok": top_k, "router_aux_loss_coef": 0.001})
    return {**out, "model_type": "qwen3_5_moe", "text_config": text}


# Qwen3-VL-MoE (Qwen/Qwen3-VL-30B-A3B-Instruct, Qwen/Qwen3-VL-235B-A22B-Instruct config.json):
# Qwen3-VL's 27-block ViT with deepstack mergers after blocks 8, 16, 24; a Qwen3-MoE LM with
# 128 experts, top-8, every layer sparse.
_QWEN3_VL_VISION = {
    "depth": 27, "hidden_size": 1152, "num_heads": 16, "intermediate_size": 4304,
    "patch_size": 16, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3,
    "num_position_embeddings": 2304, "deepstack_visual_indexes": [8, 16, 24],
    "hidden_act": "gelu_pytorch_tanh",
}


def _qwen3_vl_moe(hidden: int, layers: int, heads: int, moe_intermediate: int,
                  intermediate: int) -> dict:
    return {
        "model_type": "qwen3_vl_moe",
        "vision_config": {**_QWEN3_VL_VISION, "out_hidden_size": hidden},
        "text_config": {
            "hidden_size": hidden, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": intermediate,
            "moe_intermediate_size": moe_intermediate, "num_experts": 128,
            "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
            "router_aux_loss_coef": 0.001, "vocab_size": 151936,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5000000.0,
                                "mrope_section": [24, 20, 20], "mrope_interleaved": True},
            "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False,
        **_QWEN2_5_VL_TOKENS,
    }



# Qwen3-VL dense (Qwen/Qwen3-VL-4B-Instruct config.json, vendored with its vision_config in public
# repos; Qwen/Qwen3-VL-8B-Instruct: 36 layers of width 4096, 32 heads / 8 KV heads, the 27-block
# 1152-wide ViT of the 8B and 32B, 262,144 positions, as public notes on its config.json state, and
# a Qwen3-8B FFN of 12288 - the count then equals its BF16 index's total_size / 2 exactly).
_QWEN3_VL_4B_VISION = {**_QWEN3_VL_VISION, "depth": 24, "hidden_size": 1024,
                       "intermediate_size": 4096, "deepstack_visual_indexes": [5, 11, 17]}


def _qwen3_vl(vision: dict, hidden: int, layers: int, intermediate: int, tied: bool) -> dict:
    out = _qwen3_vl_moe(hidden, layers, 32, 0, intermediate)
    drop = ("moe_intermediate_size", "num_experts", "num_experts_per_tok", "decoder_sparse_step",
            "mlp_only_layers", "router_aux_loss_coef")
    text = {k: v for k, v in out["text_config"].items() if k not in drop}
    text.update({"num_key_value_heads": 8, "tie_word_embeddings": tied})
    return {**out, "model_type": "qwen3_vl", "vision_config": {**vision, "out_hidden_size": hidden},
            "text_config": text, "tie_word_embeddings": tied}

# InternVL3 (OpenGVLab/InternVL3-*-hf, transformers' ``internvl``): InternViT-300M-448px-V2.5
# (1B-14B: 24 layers, width 1024, 16 heads, LayerNorm) or InternViT-6B-448px-V2.5 (38B, 78B: 45
# layers, width 3200, 25 heads, RMSNorm with q/k norm), 448-px tiles of 14-px patches, pixel
# shuffle 0.5, and the Qwen2.5 LM of the size (vocabulary 151674: text TP <= 2 unless padded).
_INTERNVIT_300M = {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16,
                   "intermediate_size": 4096, "norm_type": "layer_norm", "use_qk_norm": False,
                   "layer_scale_init_value": 0.1, "image_size": [448, 448], "patch_size": [14, 14]}
_INTERNVIT_6B = {**_INTERNVIT_300M, "hidden_size": 3200, "num_hidden_layers": 45,
                 "num_attention_heads": 25, "intermediate_size": 12800, "norm_type": "rms_norm",
                 "use_qk_norm": True}


def _internvl3(vision: dict, hidden: int, layers: int, heads: int, kv_heads: int,
               intermediate: int, tied: bool = False) -> dict:
    return {
        "model_type": "internvl",
        "vision_config": dict(vision),
        "text_config": {
            "model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": 151674,
            "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0},
            "tie_word_embeddings": tied,
        },
        "downsample_ratio": 0.5, "image_token_id": 151667, "image_seq_length": 256,
        "tie_word_embeddings": tied,
    }


# InternVL3.5-8B (OpenGVLab/InternVL3_5-8B, transformers' ``internvl`` with a ``qwen3`` text config):
# InternViT-300M-448px-V2.5 (as InternVL3's) and Qwen3-8B, the sizes InternVL's own documentation
# tables (``docs/en/internvl3.5/quick_start.md``: 0.3B vision + 8.2B language = 8.5B). Qwen3-8B: 36 layers of width 4096, 32 heads / 8 KV
# heads of 128, FFN 12288, 151,936 rows, untied - keras-hub's ``qwen3_8b_en`` preset gives its
# total, 8,190,735,360, which this LM counts exactly; image token 151671 and 40,960 positions as
# the InternVL3.5 HF configs vendored in public loader tests.
def _internvl3_5(vision: dict, hidden: int, layers: int, heads: int, kv_heads: int,
                 intermediate: int, tied: bool = False) -> dict:
    out = _internvl3(vision, hidden, layers, heads, kv_heads, intermediate, tied)
    out["text_config"].update({"model_type": "qwen3", "head_dim": 128, "vocab_size": 151936,
                               "max_position_embeddings": 40960})
    return {**out, "image_token_id": 151671}


# Qwen3-Omni-30B-A3B's thinker (Qwen/Qwen3-Omni-30B-A3B-Instruct ``thinker_config``): transformers'
# ``Qwen3OmniMoe{Audio,Vision}EncoderConfig`` defaults, documented as that checkpoint (audio: 32
# layers, d_model 1280, 20 heads, FFN 5120, 128 mel bins, convs of 480 channels, ``n_window`` 50;
# vision: Qwen3-VL's 27-block 1152-wide ViT, 16-px patches, deepstack after blocks 8, 16, 24),
# both projecting to the LM width; the LM is Qwen3-30B-A3B's shape: the text config's defaults
# for width (2048) and experts (128 of width 768, top-8), with the released 48 layers, 32 query /
# 4 KV heads of 128 (the public config as public notes on it and keras-hub's Qwen3-Omni preset
# note state) and 152,064 rows (the logits of the thinker in vLLM-Omni's transformers model-structure
# dump, ``benchmarks/qwen3-omni``). keras-hub's
# figure, 30,532,122,624, is this LM at 151,936 rows exactly (`tests/unit/test_generic_presets.py`).
def _qwen3_omni_moe_30b_a3b() -> dict:
    return {
        "model_type": "qwen3_omni_moe_thinker",
        "audio_config": {"output_dim": 2048},
        "vision_config": {"out_hidden_size": 2048},
        "text_config": {
            "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
            "num_key_value_heads": 4, "head_dim": 128, "moe_intermediate_size": 768,
            "num_experts": 128, "num_experts_per_tok": 8, "vocab_size": 152064,
            "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False,
    }


# Qwen2.5-Omni-7B's thinker (Qwen/Qwen2.5-Omni-7B ``thinker_config``; transformers'
# ``Qwen2_5OmniThinkerConfig``, whose sub-config defaults are these dims): the Qwen2.5-7B LM, the
# Qwen2.5-VL 32-block 1280-wide windowed ViT (full attention in blocks 7, 15, 23, 31) and a
# Whisper-large-v3-like audio encoder (32 layers, d_model 1280, 20 heads, FFN 5120, 128 mel bins;
# attention in chunks of 2 x n_window mel frames; its ``proj`` maps to the LM width). The talker
# and the token2wav vocoder are not part of the thinker and not trained here.
_QWEN2_5_OMNI_AUDIO = {
    "d_model": 1280, "encoder_layers": 32, "encoder_attention_heads": 20, "encoder_ffn_dim": 5120,
    "num_mel_bins": 128, "max_source_positions": 1500, "n_window": 100,
    "activation_function": "gelu",
}


def _qwen2_5_omni(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    vl = _qwen2_5_vl(hidden, layers, heads, kv_heads, intermediate)
    vision = {k: v for k, v in _QWEN2_5_VL_VISION.items() if k not in ("tokens_per_second", "in_chans")}
    return {
        "model_type": "qwen2_5_omni_thinker",
        "audio_config": {**_QWEN2_5_OMNI_AUDIO, "output_dim": hidden},
        "vision_config": {**vision, "intermediate_size": 3420, "in_channels": 3,
                          "hidden_act": "silu", "out_hidden_size": hidden},
        "text_config": {**vl["text_config"], "max_position_embeddings": 32768},
        "audio_token_index": 151646, "image_token_index": 151655, "video_token_index": 151656,
        "vision_start_token_id": 151652, "vision_end_token_id": 151653,
        "audio_start_token_id": 151647, "audio_end_token_id": 151648,
        "position_id_per_seconds": 25, "seconds_per_chunk": 2,
    }


PRESETS = {
    "internvl": {
        "1b": _internvl3(_INTERNVIT_300M, 896, 24, 14, 2, 4864, tied=True),
        "2b": _internvl3(_INTERNVIT_300M, 1536, 28, 12, 2, 8960, tied=True),
        "8b": _internvl3(_INTERNVIT_300M, 3584, 28, 28, 4, 18944),
        "14b": _internvl3(_INTERNVIT_300M, 5120, 48, 40, 8, 13824),
        "38b": _internvl3(_INTERNVIT_6B, 5120, 64, 40, 8, 27648),
        "78b": _internvl3(_INTERNVIT_6B, 8192, 80, 64, 8, 29568),
        "3.5-8b": _internvl3_5(_INTERNVIT_300M, 4096, 36, 32, 8, 12288),
    },
    "qwen2_5_vl": {
        "7b": _qwen2_5_vl(3584, 28, 28, 4, 18944),
        "32b": _qwen2_5_vl(5120, 64, 40, 8, 27648),
        "72b": _qwen2_5_vl(8192, 80, 64, 8, 29568),
    },
    "qwen2_5_omni": {
        "7b": _qwen2_5_omni(3584, 28, 28, 4, 18944),
    },
    "qwen3_omni_moe": {
        "30b-a3b": _qwen3_omni_moe_30b_a3b(),
    },
    "qwen3_5": {
        "9b": _qwen3_5(4096, 32, 16, 4, 12288, 16, 32),
        "27b": _qwen3_5(5120, 64, 24, 4, 17408, 16, 48),
    },
    "qwen3_5_moe": {
        "35b-a3b": _qwen3_5_moe(2048, 40, 16, 256, 8, 512, 32),
        "122b-a10b": _qwen3_5_moe(3072, 48, 32, 256, 8, 1024, 64),
        "397b-a17b": _qwen3_5_moe(4096, 60, 32, 512, 10, 1024, 64),
    },
    "qwen3_vl": {
        "4b": _qwen3_vl(_QWEN3_VL_4B_VISION, 2560, 36, 9728, tied=True),
        "8b": _qwen3_vl(_QWEN3_VL_VISION, 4096, 36, 12288, tied=False),
    },
    "qwen3_vl_moe": {
        "30b-a3b": _qwen3_vl_moe(2048, 48, 32, 768, 6144),
        "235b-a22b": _qwen3_vl_moe(4096, 94, 64, 1536, 12288),
    },
    **GENERIC_PRESETS,
}


def preset_dims(family: str, preset: str) -> dict:
    """A deep copy of the published dims of ``family``/``preset``; ValueError listing the known ones."""
    if family not in PRESETS:
        raise ValueError(f"model.family={family!r} has no presets; known: {sorted(PRESETS)}.")
    if preset not in PRESETS[family]:
        raise ValueError(f"model.preset={preset!r} is not known for {family}; "
                         f"known: {sorted(PRESETS[family])}.")
    return copy.deepcopy(PRESETS[family][preset])
