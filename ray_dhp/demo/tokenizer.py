"""The demo tokenizer: a byte-level BPE trained in code on the demo's captions and prompts,
with the Qwen chat format's special tokens and a Qwen2-VL-style chat template."""

from __future__ import annotations

import functools

from ray_dhp.demo.shapes import COLOURS, COUNT_WORDS, PROMPT, SHAPES

__all__ = ["SPECIAL_TOKENS", "DEFAULT_SYSTEM_PROMPT", "CHAT_TEMPLATE", "build_tokenizer"]

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
