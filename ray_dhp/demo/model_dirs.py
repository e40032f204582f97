"""Tiny model directories whose processor is the model's own transformers processor class, as a
real checkpoint ships it: ``config.json``, weights (with ``weights=True``) and the processor's
files, the tokenizer carrying the family's own special tokens and a chat template in the
family's turn format. They are what a user's downloaded model directory looks like to ray_dhp
(`ray_dhp.data.model_processor` makes the samples from it), at the demo's sizes and built
locally: the generic families' tests and docs use them.

Example::

    from ray_dhp.demo.model_dirs import model_dir
    config = model_dir("gemma3", "/tmp/gemma3", weights=True)  # then DHPConfig(model="/tmp/gemma3")
"""

from __future__ import annotations

from ray_dhp.demo.generic import IMAGE_SIDE, PATCH

__all__ = ["model_dir", "MODEL_DIRS", "GEMMA_TEMPLATE", "LLAVA_TEMPLATE"]

# Gemma-style turns; the template writes the processor's image token (<start_of_image>) per image
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>"
    "{{ 'model' if m.role == 'assistant' else m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for c in m.content %}"
    "{% if c.type == 'image' %}<start_of_image>{% else %}{{ c.text }}{% endif %}{% endfor %}"
    "{% endif %}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
    "{% endif %}")
# LLaVA-1.5-style: "USER: <image>\n... ASSISTANT: ...</s>"; eos after the reply
LLAVA_TEMPLATE = (
    "{% for m in messages %}{{ m.role.upper() }}: {% if m.content is string %}{{ m.content }}"
    "{% else %}{% for c in m.content %}{% if c.type == 'image' %}<image>\n{% else %}{{ c.text }}"
    "{% endif %}{% endfor %}{% endif %}{% if m.role == 'assistant' %}</s>{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT: {% endif %}")


def _tokenizer(extra: dict, eos: str, more: tuple = ()):
    """The demo tokenizer's vocabulary plus ``extra`` (``{attribute: token}``: the processor
    reads e.g. ``tokenizer.image_token``) and ``more`` as special tokens, ``eos`` as eos."""
    from transformers import PreTrainedTokenizerFast

    from ray_dhp.demo.tokenizer import build_tokenizer

    backend = build_tokenizer().backend_tokenizer
    tok = PreTrainedTokenizerFast(tokenizer_object=type(backend).from_str(backend.to_str()),
                                  pad_token="<|endoftext|>", eos_token=eos, bos_token="<|endoftext|>")
    tok.add_special_tokens({"additional_special_tokens": sorted(set(extra.values()) | {eos, *more})})
    return PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer, pad_token="<|endoftext|>",
                                   eos_token=eos, bos_token="<|endoftext|>", extra_special_tokens=extra)


def _gemma3(config):
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

    tok = _tokenizer({"boi_token": "<start_of_image>", "image_token": "<image_soft_token>",
                      "eoi_token": "<end_of_image>"}, eos="<end_of_turn>", more=("<start_of_turn>",))
    proc = Gemma3Processor(image_processor=Gemma3ImageProcessorPil(
        size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}), tokenizer=tok,
        chat_template=GEMMA_TEMPLATE, image_seq_length=config.mm_tokens_per_image)
    ids = {"image_token_id": "<image_soft_token>", "boi_token_id": "<start_of_image>",
           "eoi_token_id": "<end_of_image>"}
    return proc, {k: tok.convert_tokens_to_ids(t) for k, t in ids.items()}


def _llava(config):
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.llava.processing_llava import LlavaProcessor

    tok = _tokenizer({"image_token": "<image>"}, eos="</s>")
    proc = LlavaProcessor(image_processor=CLIPImageProcessorPil(
        size={"shortest_edge": IMAGE_SIDE}, crop_size={"height": IMAGE_SIDE, "width": IMAGE_SIDE}),
        tokenizer=tok, patch_size=PATCH, chat_template=LLAVA_TEMPLATE,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1)  # CLIP's class token
    return proc, {"image_token_id": tok.convert_tokens_to_ids("<image>")}


MODEL_DIRS = {"gemma3": _gemma3, "llava": _llava}


def model_dir(model_type: str, path, *, weights: bool = False, seed: int = 0):
    """Write the tiny ``model_type`` directory at ``path`` (config, the processor's files and,
    with ``weights``, random-init weights); returns the config."""
    from ray_dhp.demo.generic import tiny_generic_config

    config = tiny_generic_config(model_type)
    processor, ids = MODEL_DIRS[model_type](config)
    for key, value in ids.items():
        setattr(config, key, value)
    text = config.get_text_config()
    text.vocab_size = -(-len(processor.tokenizer) // 8) * 8
    text.eos_token_id = processor.tokenizer.eos_token_id
    processor.save_pretrained(path)
    config.save_pretrained(path)
    if weights:
        from ray_dhp.models import build_model

        build_model(config, seed=seed).save_pretrained(path)
    return config
