"""Everything the demo needs, built locally in code: tokenizer, tiny configs, processor, data.

Nothing here touches a model hub. The tokenizer is a byte-level BPE trained in code on a
small built-in corpus (deterministic: same ids in every process); the configs are random-init
sized Qwen-VL configs whose special-token ids come from that tokenizer; the processor composes
the tokenizer with transformers' PIL image processor (no torchvision needed); and
:func:`make_dataset` draws a small captioning set of coloured shapes with PIL.

Example::

    from ray_dhp.demo import make_dataset, tiny_model_config, tiny_processor
    from ray_dhp.data import read_annotations, resolve_data_root

    path = make_dataset("/tmp/shapes", num_samples=16)
    proc = tiny_processor("qwen2_5_vl")
    sample = proc.process(read_annotations(path)[0], resolve_data_root(path))
    config = tiny_model_config("qwen2_5_vl")
"""

from __future__ import annotations

import functools
import json
import random
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = [
    "FAMILIES",
    "AUDIO_FAMILIES",
    "SPECIAL_TOKENS",
    "CHAT_TEMPLATE",
    "DEFAULT_SYSTEM_PROMPT",
    "build_tokenizer",
    "tiny_model_config",
    "tiny_processor",
    "make_dataset",
    "BAD_KINDS",
]

FAMILIES = ("qwen2_5_vl", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe", "internvl")
#: families with an audio encoder (their tiny config and processor: `ray_dhp.demo_audio`)
AUDIO_FAMILIES = ("qwen2_5_omni",)

#: Special tokens of the Qwen chat format, in id order (ids 0..6 of the demo tokenizer).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)

#: Default system prompt of the Qwen2/2.5-VL-Instruct chat templates (and of :data:`CHAT_TEMPLATE`).
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."

#: Qwen2-VL-style chat template (written for ray_dhp, following the rendering rules of the
#: Qwen2/2.5-VL-Instruct templates): a conversation that does not open with a system message gets
#: :data:`DEFAULT_SYSTEM_PROMPT`; each message is ``<|im_start|>{role}\n{content}<|im_end|>\n``;
#: content is a string or a list of items: ``{"type": "image"}`` (or any item with an ``image`` /
#: ``image_url`` key) -> ``<|vision_start|><|image_pad|><|vision_end|>``, videos likewise with
#: ``<|video_pad|>``, text items verbatim; ``add_vision_id`` prefixes "Picture N: " / "Video N: ";
#: ``add_generation_prompt`` ends with ``<|im_start|>assistant\n``.
CHAT_TEMPLATE = (
    "{% set counts = namespace(image=0, video=0) %}"
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\n" + DEFAULT_SYSTEM_PROMPT + "<|im_end|>\n"
    "{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' or 'image' in item or 'image_url' in item %}"
    "{% set counts.image = counts.image + 1 %}"
    "{% if add_vision_id %}Picture {{ counts.image }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif item['type'] == 'video' or 'video' in item %}"
    "{% set counts.video = counts.video + 1 %}"
    "{% if add_vision_id %}Video {{ counts.video }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in item %}{{ item['text'] }}"
    "{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SHAPES = ("circle", "square", "triangle")
COLOURS = {"red": (220, 40, 40), "green": (40, 170, 60), "blue": (40, 80, 220), "yellow": (230, 200, 30)}
COUNT_WORDS = ("one", "two", "three")
PROMPT = "Describe the image."
BAD_KINDS = ("missing_image", "corrupt_image", "malformed_json", "image_count_mismatch", "no_assistant")

_VOCAB_TARGET = 384  # byte alphabet (256) + specials + merges; padded to a multiple of 8 in configs


def _corpus() -> list[str]:
    """Small built-in training corpus: the demo's captions, prompts and chat roles."""
    captions = []
    for count, word in enumerate(COUNT_WORDS, start=1):
        for colour in COLOURS:
            for shape in SHAPES:
                captions.append(f"{word} {colour} {shape}{'s' if count > 1 else ''}")
    extra = [
        "system", "user", "assistant", DEFAULT_SYSTEM_PROMPT, PROMPT,
        "Repeat:", "What is in the picture?", "How many shapes are there?",
    ]
    return (captions + extra) * 2


@functools.lru_cache(maxsize=None)
def build_tokenizer():
    """Build the demo tokenizer: a byte-level BPE trained in code, with Qwen special tokens.

    Deterministic (same vocabulary and ids in every process) and cached. Special tokens get ids
    0..6 in the order of :data:`SPECIAL_TOKENS`; ``<|endoftext|>`` is the pad token and
    ``<|im_end|>`` the eos token. The tokenizer carries :data:`CHAT_TEMPLATE`.

    Returns:
        A ``transformers.PreTrainedTokenizerFast`` (about 380 tokens).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_VOCAB_TARGET, special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False, min_frequency=1,
    )
    tok.train_from_iterator(_corpus(), trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<|endoftext|>", eos_token="<|im_end|>",
        extra_special_tokens={
            "image_token": "<|image_pad|>", "video_token": "<|video_pad|>",
            "vision_start_token": "<|vision_start|>", "vision_end_token": "<|vision_end|>",
        },
        chat_template=CHAT_TEMPLATE, model_max_length=32768,
    )


def _token_ids() -> dict:
    tok = build_tokenizer()
    ids = {name: tok.convert_tokens_to_ids(t) for name, t in [
        ("image_token_id", "<|image_pad|>"), ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"), ("vision_end_token_id", "<|vision_end|>"),
    ]}
    ids["pad_token_id"], ids["eos_token_id"] = tok.pad_token_id, tok.eos_token_id
    return ids


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


def _check_family(family: str) -> None:
    if family not in FAMILIES + AUDIO_FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {FAMILIES + AUDIO_FAMILIES}")


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
#: 300M tower), pixel shuffle 0.5 and a Qwen2 LM with 1-D RoPE.
_TINY_INTERNVL_TILE = 56
_TINY_INTERNVL_VISION = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                         "intermediate_size": 64, "image_size": _TINY_INTERNVL_TILE,
                         "patch_size": 14, "norm_type": "layer_norm", "use_qk_norm": False,
                         "use_mean_pooling": True, "hidden_dropout_prob": 0.0,
                         "attention_dropout": 0.0, "projection_dropout": 0.0}


def _tiny_internvl(tie_word_embeddings: bool):
    from transformers import InternVLConfig

    ids = _token_ids()
    vocab = -(-len(build_tokenizer()) // 8) * 8
    text = {**_text_config(ids, vocab), "model_type": "qwen2", "tie_word_embeddings": tie_word_embeddings,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
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

    ``"qwen2_5_omni"``: the Qwen2.5-Omni *thinker* (`ray_dhp.demo_audio.omni_config`).
    """
    _check_family(family)
    if family == "internvl":
        return _tiny_internvl(tie_word_embeddings)
    if family in AUDIO_FAMILIES:
        from ray_dhp.demo_audio import omni_config, omni_tokenizer

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


def tiny_processor(family: str = "qwen2_5_vl", *, min_side: int = 56, max_side: int = 112):
    """A :class:`ray_dhp.data.VLProcessor` matching :func:`tiny_model_config` of ``family``.

    It composes :func:`build_tokenizer` with transformers' PIL ``Qwen2VLImageProcessorPil``
    (no torchvision needed). Its patch, merge and temporal patch sizes equal the config's, and
    images are resized to between ``min_side**2`` and ``max_side**2`` pixels (56..112 px per
    side gives grids of 4x4..8x8 patches at patch size 14).

    Args:
        family: ``"qwen2_5_vl"`` (default), ``"qwen2_vl"``, ``"qwen3_vl"``, ``"qwen3_vl_moe"``,
            ``"qwen3_5"`` or ``"qwen3_5_moe"``.
        min_side: side of the smallest image area, in pixels.
        max_side: side of the largest image area, in pixels.

    ``"qwen2_5_omni"``: with an audio feature extractor (`ray_dhp.demo_audio.omni_processor`).
    """
    _check_family(family)
    if family in AUDIO_FAMILIES:
        from ray_dhp.demo_audio import omni_processor, omni_tokenizer

        images = tiny_processor("qwen2_5_vl", min_side=min_side, max_side=max_side).image_processor
        return omni_processor(omni_tokenizer(build_tokenizer(), CHAT_TEMPLATE), images)
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    from ray_dhp.data.processing import VLProcessor

    if family == "internvl":
        return VLProcessor(build_tokenizer(), _tiny_tiler(max_side))

    geo = _vision_geometry(family)
    scale = geo["patch_size"] / 14  # keep the same patch grid for 16-px patches
    image_processor = Qwen2VLImageProcessorPil(
        min_pixels=int((min_side * scale) ** 2), max_pixels=int((max_side * scale) ** 2),
        patch_size=geo["patch_size"], merge_size=geo["spatial_merge_size"],
        temporal_patch_size=geo["temporal_patch_size"],
    )
    return VLProcessor(build_tokenizer(), image_processor, video_timestamps=family == "qwen3_vl")


def _tiny_tiler(max_side: int):
    """InternVL's tiling (transformers' PIL ``GotOcr2ImageProcessorPil``: the image cut into 1..N
    tiles of the closest aspect ratio plus a thumbnail) at the tiny tile size, as patch rows
    (`ray_dhp.data.tiles.TileImageProcessor`); at most ``(max_side // tile)**2`` tiles."""
    from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil

    from ray_dhp.data.tiles import TileImageProcessor

    tile = _TINY_INTERNVL_TILE
    tiler = GotOcr2ImageProcessorPil(size={"height": tile, "width": tile}, crop_to_patches=True,
                                     min_patches=1, max_patches=max(1, (max_side // tile) ** 2))
    return TileImageProcessor(tiler, patch_size=14, merge_size=2)


def _caption(count: int, colour: str, shape: str) -> str:
    return f"{COUNT_WORDS[count - 1]} {colour} {shape}{'s' if count > 1 else ''}"


def _draw(size: tuple[int, int], count: int, colour: str, shape: str, rng: random.Random):
    """Draw ``count`` shapes side by side, each in its own horizontal slot, on white."""
    from PIL import Image, ImageDraw

    width, height = size
    image = Image.new("RGB", (width, height), (245, 245, 245))
    draw = ImageDraw.Draw(image)
    slot = width / count
    for i in range(count):
        side = max(6, int(min(slot, height) * rng.uniform(0.5, 0.8)))
        x0 = int(i * slot + rng.uniform(0, slot - side))
        y0 = int(rng.uniform(0, height - side))
        box = (x0, y0, x0 + side, y0 + side)
        fill = COLOURS[colour]
        if shape == "circle":
            draw.ellipse(box, fill=fill)
        elif shape == "square":
            draw.rectangle(box, fill=fill)
        else:
            draw.polygon([(x0, y0 + side), (x0 + side, y0 + side), (x0 + side // 2, y0)], fill=fill)
    return image


def _record(i: int, caption: str, image: str | None) -> dict:
    if image is None:
        human = f"Repeat: {caption}"
        return {"id": f"{i:05d}", "conversations": [
            {"from": "human", "value": human}, {"from": "gpt", "value": caption}]}
    return {"id": f"{i:05d}", "image": image, "conversations": [
        {"from": "human", "value": f"<image>\n{PROMPT}"}, {"from": "gpt", "value": caption}]}


def _apply_bad(record: dict, kind: str, root: Path) -> str | None:
    """Spoil ``record`` in place as ``kind``; return a replacement JSONL line if the line itself is bad."""
    if kind not in BAD_KINDS:
        raise ValueError(f"unknown bad-line kind {kind!r}; choose one of {BAD_KINDS}")
    if kind == "malformed_json":
        return json.dumps(record)[:-7]
    if kind == "no_assistant":
        record["conversations"] = record["conversations"][:1]
        return None
    if "image" not in record:
        raise ValueError(f"bad-line kind {kind!r} needs an image sample, got a text-only one")
    if kind == "missing_image":
        record["image"] = record["image"].replace(".png", "_missing.png")
    elif kind == "corrupt_image":
        (root / record["image"]).write_bytes(b"\x89PNG\r\n\x1a\nthis is not an image")
    else:  # image_count_mismatch: two placeholders, one image
        record["conversations"][0]["value"] = f"<image>\n<image>\n{PROMPT}"
    return None


def make_dataset(
    path, num_samples: int = 64, seed: int = 0, *,
    image_sizes: Sequence[tuple[int, int]] = ((56, 56), (84, 56), (112, 84)),
    text_only_every: int = 0, bad_lines: Iterable[tuple[int, str]] = (),
) -> Path:
    """Write a small LLaVA-format captioning set of coloured shapes; return its ``data.jsonl``.

    Sample ``i`` shows 1-3 circles, squares or triangles of one colour (red, green, blue,
    yellow) on a plain background, captioned e.g. ``"two red circles"``; image sizes cycle
    through ``image_sizes`` (width, height). Same ``seed`` -> same files, byte for byte.

    Args:
        path: output folder (created); images go to ``path/images/``.
        num_samples: number of JSONL lines.
        seed: seed of the shape/colour/count/position choices.
        image_sizes: (width, height) pairs, cycled over the image samples.
        text_only_every: if ``k > 0``, every k-th sample (i % k == k - 1) is text-only
            ("Repeat: <caption>"), with no ``image`` key and no ``<image>``.
        bad_lines: ``(sample_index, kind)`` pairs spoiling samples for tests; kinds are
            :data:`BAD_KINDS`: ``missing_image`` (path to a file that does not exist),
            ``corrupt_image`` (file with garbage bytes), ``malformed_json`` (truncated line),
            ``image_count_mismatch`` (two ``<image>`` for one image), ``no_assistant`` (no gpt turn).
    """
    root = Path(path)
    (root / "images").mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    bad = dict(bad_lines)
    lines = []
    for i in range(num_samples):
        count, colour, shape = rng.randint(1, 3), rng.choice(list(COLOURS)), rng.choice(SHAPES)
        caption = _caption(count, colour, shape)
        image = None
        if not (text_only_every > 0 and i % text_only_every == text_only_every - 1):
            image = f"images/{i:03d}.png"
            size = tuple(image_sizes[i % len(image_sizes)])
            _draw(size, count, colour, shape, rng).save(root / image, format="PNG")
        record = _record(i, caption, image)
        line = _apply_bad(record, bad[i], root) if i in bad else None
        lines.append(line if line is not None else json.dumps(record))
    out = root / "data.jsonl"
    out.write_text("\n".join(lines) + "\n")
    return out

