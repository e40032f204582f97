"""Published dims of the generic families (`ray_dhp.models.generic`), merged into
`ray_dhp.cli.presets.PRESETS` (`preset_dims` stays the one entry point).

Sources, by family (the Gemma line's in `ray_dhp.cli.presets_gemma`, the LLaVA line's in
`ray_dhp.cli.presets_llava`, the OCR / document families' in `ray_dhp.cli.presets_ocr`):

- ``mistral3`` 24b: ``Mistral-Small-3.1-24B`` (Pixtral tower + Mistral text).
- ``idefics3`` 8b: ``Idefics3-8B-Llama3`` (SigLIP at 364 px + Llama 3 8B).
- ``glm4v`` 9b: ``GLM-4.1V-9B`` (its ViT on patch rows + GLM-4 9B).
- ``llama4`` scout-17b-16e: the released ``meta-llama/Llama-4-Scout-17B-16E`` ``config.json``
  (vendored by TensorRT-LLM's and NxD Inference's Llama 4 tests); its text dims are also
  transformers' ``Llama4TextConfig`` defaults, whose docstring names that checkpoint.
- ``glm4v_moe`` 106b-a12b (GLM-4.5V) and ``glm46v`` 9b (GLM-4.6V-Flash, GLM-4.1V-9B's
  architecture): transformers' ``Glm4vMoeConfig`` / ``Glm46VConfig`` defaults, documented there
  as the "GLM-4.5V" / "GLM-4.6V style configuration".
- ``ernie4_5_vl_moe`` 28b-a3b: transformers' ``Ernie4_5_VLMoeConfig`` defaults (its docstring
  checkpoint ``baidu/ERNIE-4.5-VL-28B-A3B-PT``).
- ``kimi_k25`` 1t-a32b: the released ``moonshotai/Kimi-K2.5`` ``text_config`` (Kimi K2: a
  DeepSeek-V3 MLA + MoE LM, vendored in public loader tests) and its MoonViT tower, which is
  transformers' ``Kimi_K25VisionConfig`` default (27 layers, width 1152, 16 heads).
- ``smolvlm`` 2.2b: ``HuggingFaceTB/SmolVLM2-2.2B-Instruct`` as Google's AI Edge Torch
  re-authors it (``ai_edge_torch/generative/examples/smolvlm2``, whose ``verify.py`` checks it
  against that checkpoint): a SigLIP tower of 27 layers, width 1152, 16 heads, FFN 4304 on a
  27 x 27 grid of 14-px patches (``image_size`` 378 there), pixel shuffle 3, a bias-free
  connector, and a SmolLM2-1.7B-shaped LM (24 layers, width 2048, 32 heads = 32 KV heads, FFN
  8192, 49,280-token vocabulary, untied head), image token 49190.
- ``lfm2_vl`` 450m: the released ``LiquidAI/LFM2-VL-450M`` ``config.json`` (vendored with its
  model card in public repos, e.g. ``varun00391/local-finetuned-model``): SigLIP2 NaFlex base (12 layers, width 768, 256 positions), a
  2-layer projector of width 2560 after a 2x2 pixel unshuffle, and LFM2-350M (16 layers of
  width 1024: 10 short-convolution and 6 attention layers, 16 heads / 8 KV heads, FFN 6656 before
  LFM2's auto-adjustment, 65,536 tokens, tied).
- ``minicpmv4_6`` 1.3b: ``openbmb/MiniCPM-V-4.6``'s ``config.json`` as TensorRT-LLM's MiniCPM-V
  4.6 config test transcribes it: SigLIP2-400M (27 layers, width 1152, FFN 4304, 14-px patches,
  the window-attention merger after layer 6) and a Qwen3.5-0.8B hybrid LM (24 layers of width
  1024, one gated-attention layer in 4, head_dim 256, 8 heads / 2 KV heads, FFN 3584, Gated
  DeltaNet 16 + 16 heads of 128, 248,094 tokens, tied).
- ``cohere2_vision`` 112b: ``CohereLabs/command-a-vision-07-2025`` (Command A Vision) as
  KerasFormers' ``cohere2_vision/config.py`` transcribes its ``config.json``: a SigLIP2 so400m
  tower at 512 px (27 layers, width 1152, 16 heads, FFN 4304, 16-px patches, pixel-shuffled 2x2)
  with a SwiGLU connector of width 36,864, and Command A (64 layers, width 12288, 96 heads / 8 KV
  heads of 128, FFN 36864, one full-attention layer in 4 beside 4,096-token sliding windows,
  256,000 rows, tied). The tower's pooling head is left out: the model reads
  ``last_hidden_state``, and the checkpoint's 223.7 GB of F16 (public model tables) leaves no
  room for it.
- ``mistral_large4`` 1t-a52b: ``mistralai/Mistral-Large-4-1T-A52B``, transformers'
  ``MistralLarge4Config`` defaults (its docstring checkpoint; the Pixtral tower's dims spelled out
  there: 30 layers, width 2048, 16 heads, FFN 6144, 14-px patches up to 1,540 px; the text
  config's: 72 layers of width 6144, MLA with a 512-wide latent KV and a DSA indexer in every
  layer, layer 0 dense (FFN 24576), then 128 routed experts of width 6144, top-4, plus one shared
  expert, 204,800 rows, untied).

Only the fields that shape parameters, parallel degrees and memory are listed (token ids
included so a config built from them is complete).
"""

from __future__ import annotations

from ray_dhp.cli.presets_gemma import GEMMA_PRESETS
from ray_dhp.cli.presets_llava import LLAVA_PRESETS
from ray_dhp.cli.presets_ocr import OCR_PRESETS


def _mistral3(hidden: int, layers: int, heads: int, kv_heads: int, intermediate: int) -> dict:
    return {
        "model_type": "mistral3",
        "vision_config": {  # Pixtral: images up to 1,540 px, 14-px patches, 2x2 merged
            "model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
            "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64,
            "image_size": 1540, "patch_size": 14, "num_channels": 3,
        },
        "text_config": {
            "model_type": "mistral", "hidden_size": hidden, "intermediate_size": intermediate,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv_heads, "head_dim": 128, "vocab_size": 131072,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False, "image_token_index": 10, "spatial_merge_size": 2, "vision_feature_layer": -1,
        "multimodal_projector_bias": False, "projector_hidden_act": "gelu",
    }


def _idefics3_8b() -> dict:
    return {
        "model_type": "idefics3",
        "vision_config": {  # SigLIP so400m at 364 px: 26x26 patches, pixel-shuffled 2x2 -> 169 rows
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "image_size": 364, "patch_size": 14,
        },
        "text_config": {
            "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "vocab_size": 128259, "rope_theta": 500000.0, "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
        },
        "scale_factor": 2, "image_token_id": 128257,
    }


def _glm4v_9b() -> dict:
    return {
        "model_type": "glm4v",
        "vision_config": {  # patch rows + image_grid_thw, 2x2 merged
            "hidden_size": 1536, "depth": 24, "num_heads": 12, "intermediate_size": 13696,
            "image_size": 336, "patch_size": 14, "out_hidden_size": 4096,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        "text_config": {
            "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 2, "intermediate_size": 13696, "vocab_size": 151552,
            "max_position_embeddings": 65536,
        },
    }


def _llama4_scout() -> dict:
    return {
        "model_type": "llama4",
        "vision_config": {  # 336-px tiles of 14-px patches, pixel shuffle 0.5: 144 rows a tile
            "hidden_size": 1408, "intermediate_size": 5632, "num_hidden_layers": 34,
            "num_attention_heads": 16, "image_size": 336, "patch_size": 14,
            "pixel_shuffle_ratio": 0.5, "projector_input_dim": 4096,
            "projector_output_dim": 4096, "vision_output_dim": 4096,
            "multi_modal_projector_bias": False,
        },
        "text_config": {  # every layer sparse: 16 routed experts, top-1, plus a shared expert
            "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
            "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8,
            "head_dim": 128, "num_local_experts": 16, "num_experts_per_tok": 1,
            "interleave_moe_layer_step": 1, "vocab_size": 202048, "use_qk_norm": True,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-5,
            "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False, "image_token_index": 200092, "boi_token_index": 200080,
        "eoi_token_index": 200081,
    }


_GLM4V_VISION = {  # patch rows + image_grid_thw, 2x2 merged (GLM-4.1V's tower)
    "hidden_size": 1536, "depth": 24, "num_heads": 12, "intermediate_size": 13696,
    "image_size": 336, "patch_size": 14, "out_hidden_size": 4096, "spatial_merge_size": 2,
    "temporal_patch_size": 2,
}


def _glm4_5v() -> dict:
    return {
        "model_type": "glm4v_moe",
        "vision_config": dict(_GLM4V_VISION),
        "text_config": {  # GLM-4.5-Air: layer 0 dense, then 128 routed experts (top-8) + 1 shared
            "hidden_size": 4096, "intermediate_size": 10944, "num_hidden_layers": 46,
            "num_attention_heads": 96, "num_key_value_heads": 8, "attention_bias": True,
            "moe_intermediate_size": 1408, "n_routed_experts": 128, "n_shared_experts": 1,
            "num_experts_per_tok": 8, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "vocab_size": 151424, "tie_word_embeddings": False,
        },
        "tie_word_embeddings": False,
    }


def _glm4_6v_flash() -> dict:
    return {
        "model_type": "glm46v",
        "vision_config": dict(_GLM4V_VISION),
        "text_config": {
            "hidden_size": 4096, "num_hidden_layers": 40, "num_attention_heads": 32,
            "num_key_value_heads": 2, "intermediate_size": 13696, "vocab_size": 151552,
        },
        "tie_word_embeddings": False,
    }


def _ernie4_5_vl_28b() -> dict:
    return {
        "model_type": "ernie4_5_vl_moe",
        "vision_config": {  # Qwen2-VL-style ViT on patch rows, 2x2 merged
            "depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 5120,
            "patch_size": 14, "spatial_merge_size": 2,
        },
        "text_config": {  # per sparse layer: 64 text + 64 vision experts (width 1536 / 512), top-6
            "hidden_size": 2560, "intermediate_size": 12288, "num_hidden_layers": 28,
            "num_attention_heads": 20, "num_key_value_heads": 4, "vocab_size": 103424,
            "moe_intermediate_size": [1536, 512], "moe_num_experts": 64, "moe_k": 6,
            "moe_num_shared_experts": 2, "tie_word_embeddings": True,
        },
        "tie_word_embeddings": True,
    }


def _kimi_k25() -> dict:
    return {
        "model_type": "kimi_k25",
        "vision_config": {  # MoonViT on 14-px patches, 2x2 merged
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "patch_size": 14, "merge_kernel_size": [2, 2],
            "pos_emb_height": 64, "pos_emb_width": 64, "pos_emb_time": 4,
        },
        "text_config": {  # Kimi K2: MLA, layer 0 dense, then 384 routed experts (top-8) + 1 shared
            "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432,
            "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
            "num_key_value_heads": 64, "q_lora_rank": 1536, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
            "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
            "routed_scaling_factor": 2.827, "norm_topk_prob": True, "vocab_size": 163840,
            "max_position_embeddings": 262144, "tie_word_embeddings": False,
        },
        "projection_hidden_size": 1152, "tie_word_embeddings": False,
    }


def _smolvlm2_2_2b() -> dict:
    return {
        "model_type": "smolvlm",
        "vision_config": {  # 27 x 27 patches a tile, pixel-shuffled 3x3 -> 81 LM rows
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "image_size": 378, "patch_size": 14,
        },
        "text_config": {
            "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 32,
            "vocab_size": 49280, "tie_word_embeddings": False,
        },
        "scale_factor": 3, "image_token_id": 49190, "tie_word_embeddings": False,
    }


def _lfm2_vl_450m() -> dict:
    conv, attn = "conv", "full_attention"
    return {
        "model_type": "lfm2_vl",
        "vision_config": {  # NaFlex: 16-px patches, a 16 x 16 position table resized per image
            "model_type": "siglip2_vision_model", "hidden_size": 768, "intermediate_size": 3072,
            "num_hidden_layers": 12, "num_attention_heads": 12, "num_patches": 256,
            "patch_size": 16, "vision_use_head": False,
        },
        "text_config": {
            "model_type": "lfm2", "hidden_size": 1024, "intermediate_size": 6656,
            "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
            "vocab_size": 65536, "max_position_embeddings": 128000, "norm_eps": 1e-5,
            "layer_types": [conv, conv, attn, conv, conv, attn, conv, conv, attn, conv, attn,
                            conv, attn, conv, attn, conv],
        },
        "downsample_factor": 2, "projector_hidden_size": 2560, "projector_bias": True,
        "image_token_id": 396, "tie_word_embeddings": True,
    }


def _minicpm_v4_6() -> dict:
    return {
        "model_type": "minicpmv4_6",
        "vision_config": {
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "image_size": 980, "patch_size": 14,
        },
        "text_config": {  # Qwen3.5-0.8B: 3 Gated DeltaNet layers per gated-attention layer
            "model_type": "qwen3_5_text", "hidden_size": 1024, "intermediate_size": 3584,
            "num_hidden_layers": 24, "num_attention_heads": 8, "num_key_value_heads": 2,
            "head_dim": 256, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
            "linear_key_head_dim": 128, "linear_num_key_heads": 16,
            "linear_num_value_heads": 16, "linear_value_head_dim": 128, "vocab_size": 248094,
            "max_position_embeddings": 262144, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        },
        "insert_layer_id": 6, "image_size": 1120, "drop_vision_last_layer": False,
        "image_token_id": 248056, "video_token_id": 248057, "tie_word_embeddings": True,
    }


def _command_a_vision() -> dict:
    return {
        "model_type": "cohere2_vision",
        "vision_config": {  # SigLIP2 so400m at 512 px: 32 x 32 patches, 256 LM rows per tile
            "model_type": "siglip_vision_model", "hidden_size": 1152, "intermediate_size": 4304,
            "num_hidden_layers": 27, "num_attention_heads": 16, "image_size": 512,
            "patch_size": 16, "vision_use_head": False,
        },
        "text_config": {  # Command A
            "model_type": "cohere2", "hidden_size": 12288, "intermediate_size": 36864,
            "num_hidden_layers": 64, "num_attention_heads": 96, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 256000, "sliding_window": 4096,
            "layer_norm_eps": 1e-5, "tie_word_embeddings": True,
        },
        "downsample_factor": 2, "alignment_intermediate_size": 36864, "image_token_id": 255036,
        "tie_word_embeddings": True,
    }


def _mistral_large4() -> dict:
    return {
        "model_type": "mistral_large4",
        "vision_config": {  # Pixtral-style: 14-px patches, images up to 1,540 px, 2x2 merged
            "model_type": "pixtral", "hidden_size": 2048, "intermediate_size": 6144,
            "num_hidden_layers": 30, "num_attention_heads": 16, "patch_size": 14,
            "image_size": 1540, "hidden_act": "silu",
        },
        "text_config": {  # MLA + DSA indexer; layer 0 dense, then 128 routed experts (top-4) + 1 shared
            "vocab_size": 204800, "hidden_size": 6144, "intermediate_size": 24576,
            "moe_intermediate_size": 6144, "num_hidden_layers": 72, "num_attention_heads": 64,
            "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 128,
            "num_experts_per_tok": 4, "kv_lora_rank": 512, "qk_rope_head_dim": 64,
            "v_head_dim": 128, "qk_nope_head_dim": 64, "index_head_dim": 128,
            "index_n_heads": 32, "index_topk": 2048, "first_k_dense_replace": 1,
            "max_position_embeddings": 1048576, "tie_word_embeddings": False,
        },
        "image_token_index": 10, "spatial_merge_size": 2, "multimodal_projector_bias": False,
        "tie_word_embeddings": False,
    }


GENERIC_PRESETS = {
    **OCR_PRESETS,
    **GEMMA_PRESETS,
    **LLAVA_PRESETS,
    "idefics3": {"8b": _idefics3_8b()},
    "glm4v": {"9b": _glm4v_9b()},
    "mistral3": {"24b": _mistral3(5120, 40, 32, 8, 32768)},
    "llama4": {"scout-17b-16e": _llama4_scout()},
    "glm4v_moe": {"106b-a12b": _glm4_5v()},
    "glm46v": {"9b": _glm4_6v_flash()},
    "ernie4_5_vl_moe": {"28b-a3b": _ernie4_5_vl_28b()},
    "kimi_k25": {"1t-a32b": _kimi_k25()},
    "smolvlm": {"2.2b": _smolvlm2_2_2b()},
    "lfm2_vl": {"450m": _lfm2_vl_450m()},
    "minicpmv4_6": {"1.3b": _minicpm_v4_6()},
    "cohere2_vision": {"112b": _command_a_vision()},
    "mistral_large4": {"1t-a52b": _mistral_large4()},
}
