"""A processor read from a local model directory as transformers reads it, whatever is installed.

`find_chat_template` looks where transformers looks, in its order: the processor's own template
(``ProcessorMixin.from_pretrained``: a ``chat_template`` key of ``processor_config.json``, else
``chat_template.jinja``, else the legacy ``chat_template.json`` that Hub VL repos ship), then the
tokenizer's (``tokenizer_config.json``'s ``chat_template``). `read_processor_dir` always gives
that template, so the prompt does not depend on whether ``AutoProcessor`` can be built (it cannot
without torchvision, and ``AutoTokenizer`` alone ignores ``chat_template.json``).

`check_processor_fits` (in the driver, `ray_dhp.data.compat`) then compares it with the model.
"""

from __future__ import annotations

import json
import os
from typing import Optional

__all__ = ["ProcessorDirError", "find_chat_template", "read_processor_dir", "renders_timestamps",
           "TEMPLATE_FILES"]

#: where a chat template is looked for, in transformers' order of precedence
TEMPLATE_FILES = ("processor_config.json", "chat_template.jinja", "chat_template.json",
                  "tokenizer_config.json")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json")


class ProcessorDirError(ValueError):
    """A processor directory that cannot give a usable processor (names the file)."""


def _json(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ProcessorDirError(f"{path}: not readable JSON ({type(e).__name__}: {e})") from None
    return data if isinstance(data, dict) else {}


def _default(template):
    """The default template of a template value (a string, ``{name: text}`` or, in older
    tokenizer configs, ``[{"name": ..., "template": ...}]``)."""
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) and template.strip() else None


def find_chat_template(path: str) -> tuple[Optional[str], Optional[str]]:
    """``(template, file it came from)`` of a model directory, or ``(None, None)`` (see the
    module docstring for the order)."""
    for name in TEMPLATE_FILES:
        file = os.path.join(path, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".jinja"):
            with open(file, encoding="utf-8") as f:
                template = _default(f.read())
        else:
            template = _default(_json(file).get("chat_template"))
        if template is not None:
            return template, name
    return None, None


def _tokenizer(path: str):
    from transformers import AutoTokenizer

    if not any(os.path.isfile(os.path.join(path, n)) for n in _TOKENIZER_FILES):
        raise ProcessorDirError(f"processor directory {path} has no tokenizer files (none of "
                                f"{', '.join(_TOKENIZER_FILES)}); copy the model's tokenizer "
                                "there or point processor.path at a directory that has one")
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - transformers raises OSError, ValueError, KeyError...
        raise ProcessorDirError(f"processor directory {path}: the tokenizer does not load "
                                f"({type(e).__name__}: {str(e)[:300]})") from e


def _image_processor(path: str, fmt):
    """The directory's image processor: ``AutoImageProcessor``'s when it loads (a full
    install), else the format's PIL-only one (`PromptFormat.fallback_image_processor`: no
    torchvision); None without ``preprocessor_config.json``."""
    if not os.path.isfile(os.path.join(path, "preprocessor_config.json")):
        return None
    try:
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(path, local_files_only=True)
    except (ImportError, ValueError, OSError, TypeError, AttributeError):
        pass
    try:
        return fmt.fallback_image_processor().from_pretrained(path, local_files_only=True)
    except Exception as e:  # noqa: BLE001
        raise ProcessorDirError(f"{os.path.join(path, 'preprocessor_config.json')}: the image "
                                f"processor does not load ({type(e).__name__}: {e})") from e


def renders_timestamps(path: str, fmt) -> bool:
    """Whether the directory's processor writes frame timestamps into the prompt
    (`PromptFormat.renders_timestamps` of its ``processor_class`` in processor_config.json /
    (video_)preprocessor_config.json)."""
    for name in ("processor_config.json", "preprocessor_config.json", "video_preprocessor_config.json"):
        try:
            with open(os.path.join(path, name), encoding="utf-8") as f:
                cls = str(json.load(f).get("processor_class", ""))
        except (OSError, ValueError, AttributeError):
            continue
        if fmt.renders_timestamps(cls):
            return True
    return False


def read_processor_dir(path: str, fmt) -> tuple:
    """``(tokenizer, image processor or None, chat template or None, the template's file or
    None)`` of a local model directory in the family's `PromptFormat` ``fmt``
    (`ray_dhp.data.processing.load_processor` makes them a `VLProcessor`).

    Raises:
        ProcessorDirError: not a directory, no tokenizer files, or a tokenizer or image
            processor that does not load.
    """
    if not os.path.isdir(path):
        raise ProcessorDirError(f"processor path {path!r} is not a local directory")
    template, source = find_chat_template(path)
    return (_tokenizer(path), _image_processor(path, fmt), template,
            os.path.join(path, source) if source else None)
