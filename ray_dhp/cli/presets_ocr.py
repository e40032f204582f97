"""Published dims of the generic OCR / document families (``lighton_ocr``, ``paddleocr_vl``,
``glm_ocr``, ``got_ocr2``, ``pp_chart2table``), merged into `ray_dhp.cli.presets_generic`'s
``GENERIC_PRESETS``.

Sources, by family:

- ``lighton_ocr`` 1b: ``lightonai/LightOnOCR-1B-1025``, transformers' ``LightOnOcrConfig``
  defaults (its docstring checkpoint; both sub-configs spelled out there): the Pixtral tower of
  Mistral Small 3.1 (24 layers, width 1024, 16 heads of 64, FFN 4096, 14-px patches, images up
  to 1,540 px, 2x2 merged) and Qwen3-0.6B (28 layers, width 1024, 16 heads / 8 KV heads of 128,
  FFN 3072, 151,936 rows, tied).
- ``paddleocr_vl`` 0.9b: ``PaddlePaddle/PaddleOCR-VL`` (PaddleOCR-VL-0.9B): transformers'
  ``PaddleOCRVisionConfig`` / ``PaddleOCRTextConfig`` defaults (their docstring checkpoint: a
  NaViT SigLIP of 27 layers, width 1152, 16 heads, FFN 4304 on 14-px patches, 2x2 merged, and
  ERNIE-4.5-0.3B: 18 layers, width 1024, 16 heads / 2 KV heads of 128, FFN 3072, 103,424 rows)
  with the released checkpoint's untied head (``tie_word_embeddings: false``, as transformers'
  own PaddleOCR-VL model test and candle's ``paddleocr_vl`` config defaults carry it; the
  composite config's default ties it, which would drop 0.106B).
- ``glm_ocr`` 0.9b: the released ``zai-org/GLM-OCR`` ``config.json`` (as printed in a public
  agent log on GitHub): CogViT (24 layers, width 1024, 16 heads, FFN 4096, 14-px patches, 2x2
  merged to width 1536) and GLM-0.5B (16 layers of width 1536, 16 heads / 8 KV heads of 128, FFN
  4608, 59,392 rows, untied). transformers' ``GlmOcrTextConfig`` defaults differ (width 1024,
  FFN 4096): not used. The checkpoint's one multi-token-prediction layer is not built.
- ``got_ocr2`` 580m: ``stepfun-ai/GOT-OCR-2.0-hf``: transformers' ``GotOcr2Config`` sub-config
  defaults (a SAM ViT-B tower: 12 layers, width 768, 12 heads, 16-px patches at 1,024 px,
  windowed attention with global layers 2, 5, 8, 11, 256 output channels; a Qwen-0.5B-shaped LM:
  24 layers, width 1024, 16 heads = 16 KV heads, FFN 2816, 151,860 rows, tied), as public
  loaders transcribe its ``config.json``.
- ``pp_chart2table`` 0.58b: ``PaddlePaddle/PP-Chart2Table_safetensors``, transformers'
  ``PPChart2TableConfig`` defaults (its docstring checkpoint): GOT-OCR 2.0's architecture (the
  ``got_ocr2`` preset's SAM ViT-B tower and 24-layer Qwen LM of 151,860 rows, tied).

Only the fields that shape parameters, parallel degrees and memory are listed (token ids
included so a config built from them is complete).
"""

from __future__ import annotations


def _lighton_ocr_1b() -> dict:
    return {
        "model_type": "lighton_ocr",
        "vision_config": {  # Pixtral: 14-px patches, images up to 1,540 px, 2x2 merged
            "model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
            "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64,
            "image_size": 1540, "patch_size": 14, "num_channels": 3, "hidden_act": "silu",
        },
        "text_config": {  # Qwen3-0.6B
            "model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072,
            "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
            "head_dim": 128, "vocab_size": 151936, "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        },
        "spatial_merge_size": 2, "image_token_id": 151655, "tie_word_embeddings": True,
    }


def _paddleocr_vl_0_9b() -> dict:
    return {
        "model_type": "paddleocr_vl",
        "vision_config": {  # NaViT: native-resolution 14-px patch rows, 2x2 merged
            "hidden_size": 1152, "intermediate_size": 4304, "num_hidden_layers": 27,
            "num_attention_heads": 16, "image_size": 384, "patch_size": 14,
            "spatial_merge_size": 2,
        },
        "text_config": {  # ERNIE-4.5-0.3B, its head untied in the released checkpoint
            "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 18,
            "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
            "vocab_size": 103424, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        "image_token_id": 100295, "video_token_id": 100296, "vision_start_token_id": 101305,
        "vision_end_token_id": 101306, "tie_word_embeddings": False,
    }


def _glm_ocr() -> dict:
    return {
        "model_type": "glm_ocr",
        "vision_config": {  # CogViT on patch rows, 2x2 merged
            "hidden_size": 1024, "depth": 24, "num_heads": 16, "intermediate_size": 4096,
            "image_size": 336, "patch_size": 14, "out_hidden_size": 1536,
            "spatial_merge_size": 2, "temporal_patch_size": 2,
        },
        "text_config": {  # GLM-0.5B
            "hidden_size": 1536, "intermediate_size": 4608, "num_hidden_layers": 16,
            "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
            "vocab_size": 59392, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
        },
        "image_token_id": 59280, "video_token_id": 59281, "image_start_token_id": 59256,
        "image_end_token_id": 59257, "video_start_token_id": 59258,
        "video_end_token_id": 59259, "tie_word_embeddings": False,
    }


def _got_ocr2() -> dict:
    return {
        "model_type": "got_ocr2",
        "vision_config": {  # SAM ViT-B at 1,024 px: 64 x 64 patches, 256 LM rows after its convs
            "hidden_size": 768, "output_channels": 256, "num_hidden_layers": 12,
            "num_attention_heads": 12, "image_size": 1024, "patch_size": 16, "mlp_dim": 3072,
            "window_size": 14, "global_attn_indexes": [2, 5, 8, 11],
        },
        "text_config": {
            "model_type": "qwen2", "hidden_size": 1024, "intermediate_size": 2816,
            "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16,
            "vocab_size": 151860, "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": True,
        },
        "image_token_index": 151859, "image_seq_length": 576, "tie_word_embeddings": True,
    }


def _pp_chart2table() -> dict:
    return {**_got_ocr2(), "model_type": "pp_chart2table"}  # GOT-OCR 2.0's dims


OCR_PRESETS = {
    "lighton_ocr": {"1b": _lighton_ocr_1b()},
    "paddleocr_vl": {"0.9b": _paddleocr_vl_0_9b()},
    "glm_ocr": {"0.9b": _glm_ocr()},
    "got_ocr2": {"580m": _got_ocr2()},
    "pp_chart2table": {"0.58b": _pp_chart2table()},
}
