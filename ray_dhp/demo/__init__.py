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

from ray_dhp.demo.configs import AUDIO_FAMILIES, FAMILIES, tiny_model_config
from ray_dhp.demo.processor import tiny_processor
from ray_dhp.demo.shapes import BAD_KINDS, make_dataset
from ray_dhp.demo.tokenizer import (CHAT_TEMPLATE, DEFAULT_SYSTEM_PROMPT, SPECIAL_TOKENS,
                                    build_tokenizer)

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
