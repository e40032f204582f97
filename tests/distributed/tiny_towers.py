"""The tiny Qwen vision towers' configs (hidden 32, 4 heads, depth 4), one per family with a Qwen
tower, for the Ulysses tests (`test_ulysses.py`) and the shard plan's
(``tests/unit/test_vision_plan.py``)."""

FAMILIES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5")


def tiny_vision_config(family: str, attn: str = "sdpa"):
    """A tiny vision config built through the top-level model config (hidden 32, 4 heads, depth 4)."""
    import transformers

    common = dict(depth=4, num_heads=4, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if family == "qwen2_vl":
        cfg = transformers.Qwen2VLConfig(vision_config=dict(common, embed_dim=32, hidden_size=64, mlp_ratio=2))
    elif family == "qwen2_5_vl":
        cfg = transformers.Qwen2_5_VLConfig(vision_config=dict(
            common, hidden_size=32, intermediate_size=64, out_hidden_size=64, window_size=56,
            fullatt_block_indexes=[1, 3]))
    elif family == "qwen3_5":  # Qwen3-VL's tower without deepstack
        cfg = transformers.Qwen3_5Config(vision_config=dict(
            common, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64))
    else:
        cfg = transformers.Qwen3VLConfig(vision_config=dict(
            common, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_position_embeddings=64,
            deepstack_visual_indexes=[1, 2]))
    vc = cfg.vision_config
    vc._attn_implementation = attn
    return vc
