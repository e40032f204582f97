"""Published dims of the generic Gemma-line families (``gemma3``, ``gemma4``, ``paligemma``,
``shieldgemma2``), merged into `ray_dhp.cli.presets_generic`'s ``GENERIC_PRESETS``.

Sources, by family:

- ``gemma3`` 4b/12b/27b: the variant table of transformers' ``convert_gemma3_weights.py``, with
  the released checkpoints' 262,208-token vocabulary.
- ``gemma4`` 31b: the released ``google/gemma-4-31B-it`` ``config.json`` (as printed in public
  model reports on GitHub); the tower's defaults are transformers' ``Gemma4VisionConfig``.
- ``paligemma`` 3b-224: ``google/paligemma-3b-pt-224`` (transformers' ``PaliGemmaConfig``
  defaults, with the released 257,216-token vocabulary of the ``config.json`` files transformers'
  own ColPali conversion script copies).
- ``shieldgemma2`` 4b: ``google/shieldgemma-2-4b-it`` as transformers'
  ``convert_shieldgemma2_weights_orbax_to_hf.py`` configures it: Gemma 3 4B's dims (the
  ``gemma3`` 4b preset's tower and LM: 34 layers, width 2560, 8 heads / 4 KV heads of 256, FFN
  10240, 262,208 rows, the head tied to the embedding) with 8,192 positions.

Only the fields that shape parameters, parallel degrees and memory are listed (token ids
included so a config built from them is complete).
"""

from __future__ import annotations

_GEMMA3_VISION = {  # SigLIP so400m at 896 px: 4,096 patches pooled to 256 soft tokens per image
    "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
    "num_attention_heads": 16, "num_channels": 3, "image_size": 896, "patch_size": 14,
    "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6, "vision_use_head": False,
}


def _gemma3(hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int,
            query_scale: int) -> dict:
    return {
        "model_type": "gemma3",
        "vision_config": dict(_GEMMA3_VISION),
        "text_config": {
            "hidden_size": hidden, "intermediate_size": hidden * 4, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
            "vocab_size": 262208, "sliding_window": 1024, "query_pre_attn_scalar": query_scale,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        },
        "mm_tokens_per_image": 256, "image_token_index": 262144, "boi_token_index": 255999,
        "eoi_token_index": 256000,
    }


def _gemma4_31b() -> dict:
    return {
        "model_type": "gemma4",
        "vision_config": {  # 16-px patches, 3x3 pooled: 280 soft tokens per image by default
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 72,
            "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 10240,
            "standardize": True, "use_clipped_linears": False,
        },
        "text_config": {  # sliding : full = 5 : 1; full layers: head_dim 512, 4 KV heads, K = V
            "hidden_size": 5376, "intermediate_size": 21504, "num_hidden_layers": 60,
            "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 256,
            "global_head_dim": 512, "num_global_key_value_heads": 4, "attention_k_eq_v": True,
            "hidden_size_per_layer_input": 0, "vocab_size": 262144,
            "vocab_size_per_layer_input": 262144, "sliding_window": 1024,
            "max_position_embeddings": 262144, "final_logit_softcapping": 30.0,
            "use_bidirectional_attention": "vision", "enable_moe_block": False,
            "tie_word_embeddings": True,
        },
        "audio_config": None, "tie_word_embeddings": True, "vision_soft_tokens_per_image": 280,
        "image_token_id": 258880, "video_token_id": 258884, "audio_token_id": 258881,
        "boi_token_id": 255999, "eoi_token_id": 258882,
    }


def _paligemma_3b_224() -> dict:
    return {
        "model_type": "paligemma",
        "vision_config": {  # SigLIP so400m at 224 px: 256 patches, each a soft token
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "image_size": 224, "patch_size": 14,
            "projection_dim": 2048, "vision_use_head": False,
        },
        "text_config": {  # Gemma 2B
            "model_type": "gemma", "hidden_size": 2048, "intermediate_size": 16384,
            "num_hidden_layers": 18, "num_attention_heads": 8, "num_key_value_heads": 1,
            "head_dim": 256, "vocab_size": 257216,
        },
        "hidden_size": 2048, "projection_dim": 2048, "image_token_index": 257152,
    }


def _shieldgemma2_4b() -> dict:
    out = _gemma3(2560, 34, 8, 4, 256, 256)  # Gemma 3 4B, its image classifier's head tied
    out["text_config"].update({"max_position_embeddings": 8192, "tie_word_embeddings": True})
    return {**out, "model_type": "shieldgemma2", "tie_word_embeddings": True}


GEMMA_PRESETS = {
    "gemma3": {
        "4b": _gemma3(2560, 34, 8, 4, 256, 256),
        "12b": _gemma3(3840, 48, 16, 8, 256, 256),
        "27b": _gemma3(5376, 62, 32, 16, 128, 168),
    },
    "gemma4": {"31b": _gemma4_31b()},
    "paligemma": {"3b-224": _paligemma_3b_224()},
    "shieldgemma2": {"4b": _shieldgemma2_4b()},
}
