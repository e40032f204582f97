"""The benchmark model shape and its synthetic data.

``vitheavy``: a small Qwen2.5-VL whose proportions follow the real model — a ViT much narrower than
the LLM (hidden 128 vs 256; Qwen2.5-VL-32B: 1280 vs 5120), window attention (112 px windows =
8x8 patches) with full attention only in blocks 3 and 7, 2x2 patch merging — but so small that
most of the step's FLOPs are in the ViT (long images, short prompts): the regime DHP is for.

Synthetic samples: one image of ``L`` patches per sample (grid 1 x h x w, h*w = L, h and w
multiples of the 8-patch window), random ``pixel_values``, and ``input_ids`` with ``L / 4``
``<|image_pad|>`` tokens (``mm_token_type_ids`` = 1 there) between vision start/end tokens,
followed by a short trained answer.
"""

from __future__ import annotations

import math

import torch

_VITHEAVY = dict(
    vision=dict(depth=8, hidden_size=128, num_heads=8, intermediate_size=384, out_hidden_size=256,
                fullatt_block_indexes=[3, 7], window_size=112, patch_size=14, spatial_merge_size=2,
                temporal_patch_size=2, tokens_per_second=2),
    text=dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
              intermediate_size=768),
)

SHAPES = {
    "vitheavy": _VITHEAVY,
    # The vitheavy ViT with a 2x deeper LLM: at 256 patches per image the vision and text groups
    # of a 1+1 disjoint split are comparably busy (the regime a pipeline between them is for).
    "balanced": dict(vision=_VITHEAVY["vision"], text={**_VITHEAVY["text"], "num_hidden_layers": 4}),
    # ZeRO stages (benchmarks/zero_stages.py): Qwen2.5-0.5B's text width, 2 layers, vitheavy ViT.
    "text-wide": dict(vision={**_VITHEAVY["vision"], "out_hidden_size": 896}, text=dict(
        hidden_size=896, num_hidden_layers=2, num_attention_heads=14, num_key_value_heads=2,
        intermediate_size=4864)),
    # ZeRO stages at the 7B text width (Qwen2.5-VL-7B: hidden 3584, MLP 18944, 28/4 heads), one
    # decoder layer (233 M parameters), the demo tokenizer's small vocabulary, vitheavy ViT.
    "7b-wide": dict(vision={**_VITHEAVY["vision"], "out_hidden_size": 3584}, text=dict(
        hidden_size=3584, num_hidden_layers=1, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944)),
    # For the GPU script: the same proportions, 4x wider.
    "vitheavy-wide": dict(
        vision={**_VITHEAVY["vision"], "hidden_size": 512, "intermediate_size": 1536, "out_hidden_size": 1024},
        text={**_VITHEAVY["text"], "hidden_size": 1024, "num_hidden_layers": 4, "intermediate_size": 3072},
    ),
}

PROMPT_TOKENS = 16   # text tokens before the image
ANSWER_TOKENS = 16   # trained tokens after it


def model_config(shape: str = "vitheavy"):
    """A random-init ``Qwen2_5_VLConfig`` of ``shape`` (token ids from the demo tokenizer)."""
    from ray_dhp.demo import tiny_model_config

    spec = SHAPES[shape]
    config = tiny_model_config("qwen2_5_vl")
    for k, v in spec["vision"].items():
        setattr(config.vision_config, k, v)
    tc = config.text_config
    for k, v in spec["text"].items():
        setattr(tc, k, v)
    tc.head_dim = tc.hidden_size // tc.num_attention_heads
    if getattr(tc, "layer_types", None) is not None:  # one entry per layer
        tc.layer_types = [tc.layer_types[0]] * tc.num_hidden_layers
    half = tc.head_dim // 2  # M-RoPE sections (t, h, w) must add up to head_dim / 2
    tc.rope_parameters = {**tc.rope_parameters, "mrope_section": [half - 2 * (half // 3), half // 3, half // 3]}
    tc.max_position_embeddings = 32768
    config._attn_implementation = "sdpa"
    return config


def grid_for(num_patches: int, window_patches: int = 8) -> tuple[int, int]:
    """(h, w) in patches, both multiples of the window, h*w == num_patches, as square as possible."""
    units = num_patches // (window_patches * window_patches)
    if units * window_patches ** 2 != num_patches:
        raise ValueError(f"{num_patches} patches is not a multiple of a {window_patches}x{window_patches} window")
    a = int(math.isqrt(units))
    while units % a:
        a -= 1
    return a * window_patches, (units // a) * window_patches


def make_sample(index: int, num_patches: int, config, seed: int = 0):
    """One synthetic `Sample` with a single image of ``num_patches`` patches."""
    from ray_dhp.data.sample import Sample

    g = torch.Generator().manual_seed(seed * 100_003 + index)
    vc = config.vision_config
    h, w = grid_for(num_patches, vc.window_size // vc.patch_size)
    n_img = num_patches // vc.spatial_merge_size ** 2
    vocab = config.text_config.vocab_size
    prompt = torch.randint(10, vocab, (PROMPT_TOKENS,), generator=g)
    answer = torch.randint(10, vocab, (ANSWER_TOKENS,), generator=g)
    image = torch.full((n_img,), config.image_token_id)
    ids = torch.cat([prompt, torch.tensor([config.vision_start_token_id]), image,
                     torch.tensor([config.vision_end_token_id]), answer])
    labels = torch.full_like(ids, -100)
    labels[-ANSWER_TOKENS:] = answer
    mm = (ids == config.image_token_id).long()
    dim = vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2
    pixels = torch.randn(num_patches, dim, generator=g)
    return Sample(index=index, input_ids=ids, labels=labels, mm_token_type_ids=mm,
                  pixel_values=pixels, image_grid_thw=torch.tensor([[1, h, w]]))


def make_batch(num_samples: int, num_patches: int, config, seed: int = 0) -> list:
    """``num_samples`` synthetic samples (the step's global batch, one micro-batch)."""
    return [make_sample(i, num_patches, config, seed) for i in range(num_samples)]
