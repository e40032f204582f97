"""The demo's tiny model configs: random-init sized Qwen-VL (and InternVL, Qwen2.5-Omni
thinker) configs whose special-token ids come from the demo tokenizer."""

from __future__ import annotations

from ray_dhp.demo.tokenizer import CHAT_TEMPLATE, _token_ids, build_tokenizer

__all__ = ["FAMILIES", "AUDIO_FAMILIES", "tiny_model_config"]

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl",
            "internvl3_5")
#: families with an audio encoder (their tiny config and processor: `ray_dhp.demo.audio`)
AUDIO_FAMILIES = ("qwen2_5_omni", "qwen3_omni_moe")


def _vision_geometry(family: str) -> dict:
    """Patch geometry shared by the tiny config and the tiny processor of ``family``."""
    patch = 16 if family.startswith(("qwen3_vl", "qwen3_5")) else 14
    return {"patch_size": patch, "spatial_merge_size": 2, "temporal_patch_size": 2}


def _text_config(ids: dict, vocab_size: int) -> dict:
    return {
        "vocab_size": vocab_size, "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "max_position_embeddings": 4096, "attention_dropout": 0.0, "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
        "pad_token_id": ids["pad_token_id"], "eos_token_id": ids["eos_token_id"],
        "bos_token_id": ids["pad_token_id"], "tie_word_embeddings": False, "dtype": "float32",
    }


def _vision_config(family: str) -> dict:
    geo = _vision_geometry(family)
    if family == "qwen2_vl":
        return {**geo, "depth": 4, "embed_dim": 32, "num_heads": 4, "mlp_ratio": 2, "hidden_size": 64}
    base = {**geo, "depth": 4, "hidden_size": 32, "num_heads": 4, "intermediate_size": 64,
            "out_hidden_size": 64}
    if family == "qwen2_5_vl":
        return {**base, "window_size": 56, "fullatt_block_indexes": [1, 3], "tokens_per_second": 2}
    if family.startswith("qwen3_5"):
        return {**base, "num_position_embeddings": 64}
    return {**base, "deepstack_visual_indexes": [1, 2], "num_position_embeddings": 64}


def _qwen3_5_text(text: dict) -> dict:
    """Qwen3.5's hybrid LM at tiny size: one Gated DeltaNet layer then one gated-attention layer;
    4 key / 8 value linear-attention heads of width 8 (two value heads per key head, as in the
    released models; TP 1/2/4 divide both), half-rotary heads with an interleaved M-RoPE."""
    rope = {**text["rope_parameters"], "mrope_section": [2, 1, 1], "mrope_interleaved": True,
            "partial_rotary_factor": 0.5}
    return {**text, "head_dim": 16, "rope_parameters": rope,
            "layer_types": ["linear_attention", "full_attention"], "linear_conv_kernel_dim": 4,
            "linear_num_key_heads": 4, "linear_num_value_heads": 8,
            "linear_key_head_dim": 8, "linear_value_head_dim": 8}



#: The tiny mixture-of-experts LM (``qwen3_vl_moe``): 8 experts of intermediate 32, top-2, in
#: every layer; the load-balancing loss weighs 0.05 (transformers' default 0.001 would leave
#: the router's aux gradient below what a parity test can see).
_TINY_MOE = {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "decoder_sparse_step": 1, "mlp_only_layers": [], "router_aux_loss_coef": 0.05}
#: Qwen3.5-MoE: the same routed experts (its layers are all sparse, no keys for that) plus a
#: shared expert of intermediate 64 (TP 1/2/4 divide it) behind its sigmoid gate.
_TINY_QWEN3_5_MOE = {**{k: v for k, v in _TINY_MOE.items()
                        if k not in ("decoder_sparse_step", "mlp_only_layers")},
                     "shared_expert_intermediate_size": 64}


#: Tiny InternVL: 56-px tiles of 14-px patches (4x4 patches, 2x2 feature rows per tile), an
#: InternViT of hidden 32, 4 heads, 2 layers (LayerNorm, no q/k norm, mean pooling: InternVL3's
#: 300M tower), pixel shuffle 0.5 and a Qwen2 LM with 1-D RoPE; ``internvl3_5`` (InternVL3.5)
#: the same with a Qwen3 LM (per-head q/k RMSNorms, head_dim 16, no q/k/v biases).
_TINY_INTERNVL_TILE = 56
_TINY_INTERNVL_VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 64, "image_size": _TINY_INTERNVL_TILE,
                         "patch_size": 14, "norm_type": "layer_norm", "use_qk_norm": False,
                         "use_mean_pooling": True, "hidden_dropout_prob": 0.0,
                         "attention_dropout": 0.0, "projection_dropout": 0.0}


def _tiny_internvl(tie_word_embeddings: bool, lm: str = "qwen2"):
    from transformers import InternVLConfig

    ids = _token_ids()
    vocab = -(-len(build_tokenizer()) // 8) * 8
    text = {**_text_config(ids, vocab), "model_type": lm, "tie_word_embeddings": tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    if lm == "qwen3":
        text["head_dim"] = 16
    config = InternVLConfig(text_config=text, vision_config=dict(_TINY_INTERNVL_VISION),
                            image_token_id=ids["image_token_id"], downsample_ratio=0.5,
                            image_seq_length=(_TINY_INTERNVL_TILE // 14 // 2) ** 2,
                            tie_word_embeddings=tie_word_embeddings)
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    for sub in (config, config.text_config, config.vision_config):
        sub.dtype = "float32"
    config._attn_implementation = "sdpa"
    return config


def tiny_model_config(family: str = "qwen2_5_vl", *, tie_word_embeddings: bool = False):
    """Random-init sized config of a Qwen-VL ``...ForConditionalGeneration`` model.

    Text: hidden 64, 4 query and 4 KV heads (head_dim 16; TP 1/2/4 divide both), intermediate
    128, 2 layers, M-RoPE section [2, 3, 3], vocab = tokenizer length rounded up to a multiple
    of 8. Vision: hidden 32, 4 heads, depth 4, merge 2, temporal patch 2, output 64; patch 14
    (16 for ``qwen3_vl``/``qwen3_vl_moe``/``qwen3_5``). Qwen2.5-VL adds window attention (window
    56 = 2x2 merge units, full attention in blocks 1 and 3); Qwen3-VL adds deepstack layers 1, 2
    and an 8x8 position table; Qwen3-VL-MoE is Qwen3-VL with 8 experts (intermediate 32, top-2)
    in both layers' MLPs and ``router_aux_loss_coef`` 0.05; Qwen3.5 has the 8x8 table without
    deepstack and a hybrid LM (`_qwen3_5_text`); Qwen3.5-MoE is Qwen3.5 with Qwen3-VL-MoE's
    experts in both layers plus a shared expert of intermediate 64.
    fp32, dropout 0, untied embeddings unless asked, ``sdpa`` attention. Token ids come from
    :func:`build_tokenizer`.

    Args:
        family: ``"qwen2_5_vl"`` (default), ``"qwen2_vl"``, ``"qwen3_vl"``, ``"qwen3_vl_moe"``,
            ``"qwen3_5"`` or ``"qwen3_5_moe"``.
        tie_word_embeddings: share one weight between the input embedding and ``lm_head`` (as
            Qwen2.5-VL-3B and the small Qwen3-VL models do).

    ``"internvl"``: InternVL3 (InternViT + Qwen2 LM, `_tiny_internvl`); ``"internvl3_5"``:
    InternVL3.5, the same with a Qwen3 LM (model type ``internvl``, family ``internvl``).
    ``"qwen2_5_omni"``: the Qwen2.5-Omni *thinker* (`ray_dhp.demo.audio.omni_config`);
    ``"qwen3_omni_moe"``: the Qwen3-Omni thinker (`ray_dhp.demo.audio.omni3_config`: Qwen3-VL's
    tiny ViT, Qwen3-VL-MoE's tiny LM, a tiny chunked-conv audio tower).
    """
    if family not in FAMILIES + AUDIO_FAMILIES:  # any other seam model: generic rules
        from ray_dhp.demo.generic import tiny_generic_config

        return tiny_generic_config(family)
    if family in ("internvl", "internvl3_5"):
        return _tiny_internvl(tie_word_embeddings, "qwen3" if family == "internvl3_5" else "qwen2")
    if family == "qwen3_omni_moe":
        from ray_dhp.demo.audio import QWEN3_OMNI_AUDIO_TOKENS, omni3_config, omni_tokenizer

        tok = omni_tokenizer(build_tokenizer(), CHAT_TEMPLATE, QWEN3_OMNI_AUDIO_TOKENS)
        text = {**_text_config(_token_ids(), -(-len(tok) // 8) * 8), "head_dim": 16, **_TINY_MOE}
        text["rope_parameters"] = {**text["rope_parameters"], "mrope_interleaved": True}
        return omni3_config(tok, _token_ids(), text, _vision_config("qwen3_vl"))
    if family in AUDIO_FAMILIES:
        from ray_dhp.demo.audio import omni_config, omni_tokenizer

        tok = omni_tokenizer(build_tokenizer(), CHAT_TEMPLATE)
        return omni_config(tok, _token_ids(), _text_config(_token_ids(), -(-len(tok) // 8) * 8),
                           _vision_config("qwen2_5_vl"))
    from transformers import (Qwen2_5_VLConfig, Qwen2VLConfig, Qwen3_5Config, Qwen3_5MoeConfig,
                              Qwen3VLConfig, Qwen3VLMoeConfig)

    cls = {"qwen2_5_vl": Qwen2_5_VLConfig, "qwen2_vl": Qwen2VLConfig, "qwen3_vl": Qwen3VLConfig,
           "qwen3_vl_moe": Qwen3VLMoeConfig, "qwen3_5": Qwen3_5Config,
           "qwen3_5_moe": Qwen3_5MoeConfig}[family]
    ids = _token_ids()
    vocab = -(-len(build_tokenizer()) // 8) * 8
    text = {**_text_config(ids, vocab), "tie_word_embeddings": tie_word_embeddings}
    if family.startswith("qwen3_vl"):
        text["head_dim"] = 16
        text["rope_parameters"]["mrope_interleaved"] = True
    if family.startswith("qwen3_5"):
        text = _qwen3_5_text(text)
    if family == "qwen3_vl_moe":
        text.update(_TINY_MOE)
    if family == "qwen3_5_moe":
        text = {k: v for k, v in text.items() if k != "intermediate_size"}  # no dense MLP
        text.update(_TINY_QWEN3_5_MOE)
    config = cls(
        text_config=text, vision_config=_vision_config(family), tie_word_embeddings=tie_word_embeddings,
        **{k: ids[k] for k in ("image_token_id", "video_token_id",
                               "vision_start_token_id", "vision_end_token_id")},
    )
    config.pad_token_id, config.eos_token_id = ids["pad_token_id"], ids["eos_token_id"]
    for sub in (config, config.text_config, config.vision_config):
        sub.dtype = "float32"
    config._attn_implementation = "sdpa"  # propagates to the text and vision sub-configs
    if family.endswith("_moe"):  # the per-expert loop: transformers' grouped_mm has no fp64
        config._experts_implementation = "eager"
    return config
