"""Export a ray_dhp checkpoint as a Hugging Face model directory (safetensors + config.json).

Runs in one process, no process group: the parameters are read from the sharded DCP checkpoint
with ``no_dist=True`` (DCP assembles every tensor from whichever ranks' shards hold it), put into
the transformers class of the stored config, and written with ``save_pretrained``. The result
loads with ``<ModelClass>.from_pretrained(out_dir)`` or ``DHPConfig(model=out_dir)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import warnings
from typing import Optional

import torch

logger = logging.getLogger(__name__)


def read_model_tensors(directory: str) -> dict:
    """All model parameters of the checkpoint in ``directory``, full tensors by HF name."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    empty = {k[len("model."):]: torch.empty(v.size, dtype=v.properties.dtype)
             for k, v in md.items() if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    state = {"model": empty}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": yes
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    return state["model"]


def model_config_of(meta: dict):
    """The transformers config stored in a checkpoint's metadata."""
    import transformers

    from ray_dhp.models import FAMILIES

    stored = json.loads(meta["model_config"])
    if meta["family"] not in FAMILIES:  # a generic family: transformers' own config class
        return transformers.CONFIG_MAPPING[stored["model_type"]].from_dict(stored)
    cls = getattr(transformers, FAMILIES[meta["family"]].model_class).config_class
    return cls.from_dict(stored)


def build_hf_model(config, tensors: dict, dtype: Optional[torch.dtype] = None):
    """The transformers model of ``config`` holding ``tensors`` (no random init of the weights)."""
    import transformers
    from accelerate import init_empty_weights

    from ray_dhp.models import family_of

    cls = getattr(transformers, family_of(config).model_class)
    with init_empty_weights(include_buffers=False):
        model = cls._from_config(config, dtype=next(iter(tensors.values())).dtype)
    result = model.load_state_dict(tensors, strict=False, assign=True)
    if result.unexpected_keys:
        raise ValueError(f"checkpoint tensors unknown to {cls.__name__}: {result.unexpected_keys[:5]}")
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"the checkpoint lacks parameters of {cls.__name__}: {missing[:5]}")
    return model.to(dtype) if dtype is not None else model


# Files of the source model directory that describe how to use the model, copied on export:
# generation_config.json replaces the default save_pretrained writes; chat templates are copied
# when the checkpoint's processor did not already bring one.
SOURCE_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")
# Keys transformers writes into a saved config from how it was loaded, not what the model is.
RUNTIME_KEYS = ("is_local", "local_files_only")
_CONFIG_FILES = ("tokenizer_config.json", "processor_config.json", "preprocessor_config.json")


def copy_source_files(source: Optional[str], out_dir: str) -> list:
    """Copy `SOURCE_FILES` from the source model directory ``source`` (None: nothing); the
    names copied. A source that is gone is said (a warning naming what the export lacks)."""
    if source and not os.path.isdir(source):
        from ray_dhp.data.processor_dir import find_chat_template

        lacks = ["generation_config.json (its eos and pad token ids: transformers' defaults "
                 "were written instead)"]
        if find_chat_template(out_dir)[0] is None:
            lacks.append("the chat template (chat_template.jinja / chat_template.json)")
        logger.warning("export: the source model directory %s no longer exists, so the export "
                       "lacks %s; pass the model directory the run started from with --source "
                       "DIR (Python: source=) to copy them.", source, " and ".join(lacks))
    if not source or not os.path.isdir(source):
        return []
    copied = []
    for name in SOURCE_FILES:
        src, dst = os.path.join(source, name), os.path.join(out_dir, name)
        if os.path.isfile(src) and (name == "generation_config.json" or not os.path.exists(dst)):
            shutil.copyfile(src, dst)
            copied.append(name)
    return copied


def drop_runtime_keys(out_dir: str) -> None:
    """Remove `RUNTIME_KEYS` from the tokenizer / processor configs written in ``out_dir``."""
    for name in _CONFIG_FILES:
        path = os.path.join(out_dir, name)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
        if isinstance(cfg, dict) and any(k in cfg for k in RUNTIME_KEYS):
            with open(path, "w", encoding="utf-8") as f:
                json.dump({k: v for k, v in cfg.items() if k not in RUNTIME_KEYS}, f, indent=2,
                          ensure_ascii=False)
                f.write("\n")


def _record_dtype(model) -> None:
    """config.json (and each sub-config: text, vision) says the dtype the weights are written in."""
    dtype = next(model.parameters()).dtype
    config = model.config
    for sub in [config] + [getattr(config, k, None) for k in getattr(config, "sub_configs", {})]:
        if sub is not None:
            sub.dtype = dtype


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """``"bfloat16"`` / ``"float32"`` / ``"float16"`` (or None) as a torch dtype."""
    if name is None:
        return None
    if name not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"export dtype must be float32, bfloat16 or float16, got {name!r}")
    return getattr(torch, name)


def export_hf(checkpoint, out_dir: str, *, dtype: Optional[torch.dtype] = None,
              overwrite: bool = False, source: Optional[str] = None, lora: str = "merge") -> str:
    """Write the model of a ray_dhp checkpoint as a Hugging Face directory.

    The directory is written under a temporary name next to ``out_dir`` and renamed into place
    at the end, so ``out_dir`` is never left half written; a non-empty ``out_dir`` is refused
    unless ``overwrite=True`` (then it is replaced as a whole, not merged into).

    Args:
        checkpoint: a ``ray.train.Checkpoint`` (e.g. ``result.checkpoint``) or a path: one
            checkpoint, or a folder of them (its newest complete one is used).
        out_dir: the directory to write (``config.json`` + ``model.safetensors``, plus the
            tokenizer and image processor files when the checkpoint holds them — the default
            train loop saves them — so ``AutoProcessor``/`ray_dhp.data.processing.load_processor`
            read the same directory).
        dtype: cast the weights (e.g. ``torch.bfloat16`` or ``"bfloat16"``); None keeps the
            checkpoint's dtype (fp32 for the fp32 policies and for bf16_mixed, whose
            checkpoints hold the fp32 masters). ``config.json`` records the dtype written.
        source: the model directory the run started from, for ``generation_config.json`` and
            the chat template (None: the one the checkpoint records, if it still exists).
        overwrite: replace an existing non-empty ``out_dir``.
        lora: for a run with LoRA adapters (``modules.llm.lora``): "merge" (default) writes the
            full model with the adapters merged into the weights; "adapter" writes a PEFT
            adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``, for
            ``PeftModel.from_pretrained(base_model, out_dir)``; refused if the vision tower or
            the merger trained too).

    Returns:
        ``out_dir`` as an absolute path.

    Example:
        >>> from ray_dhp import export_hf
        >>> export_hf(result.checkpoint, "/tmp/my_vlm")  # doctest: +SKIP
        >>> transformers.AutoModelForImageTextToText.from_pretrained("/tmp/my_vlm")  # doctest: +SKIP
    """
    from ray_dhp.checkpointing import checkpoint as ckpt

    out_dir = os.path.abspath(os.fspath(out_dir))
    dtype = parse_dtype(dtype) if isinstance(dtype, str) else dtype
    _check_target(out_dir, overwrite)
    with ckpt.local_dir(checkpoint) as d:
        d = ckpt.resolve(d)
        meta = ckpt.read_meta(d)
        with _staging(out_dir) as tmp:
            _write_export(d, meta, tmp, dtype, source or meta.get("source_model"), lora)
    return out_dir


def _write_export(d: str, meta: dict, out: str, dtype, source: Optional[str],
                  lora: str = "merge") -> None:
    """Everything the exported directory holds, written into ``out`` (a fresh directory)."""
    from ray_dhp.checkpointing import checkpoint as ckpt
    from ray_dhp.models import lora as lora_mod
    from ray_dhp.config.tuning import parse_tuning

    if lora not in lora_mod.LORA_EXPORTS:
        raise ValueError(f"lora must be one of {lora_mod.LORA_EXPORTS}, got {lora!r}")
    tuning = parse_tuning(meta.get("modules"))
    if lora == "adapter" and tuning.lora is None:
        raise ValueError("lora='adapter' (ray-dhp export --lora adapter): this run trained no "
                         "LoRA adapters (optim.modules.llm.lora was not set), so there is no "
                         "adapter to write; export the full model without it.")
    tensors = read_model_tensors(d)
    if tuning.lora is not None and lora == "adapter":
        lora_mod.check_adapter_export(tuning)
        base, adapters = lora_mod.split_tensors(tensors)
        lora_mod.write_adapter_dir(build_hf_model(model_config_of(meta), base, dtype), adapters,
                                   tuning.lora, out, source)
    else:
        if tuning.lora is not None:
            tensors = lora_mod.merged_tensors(tensors, tuning.lora)
        model = build_hf_model(model_config_of(meta), tensors, dtype)
        _record_dtype(model)
        model.save_pretrained(out, safe_serialization=True)
    proc = os.path.join(d, ckpt.PROCESSOR_DIR)
    if os.path.isdir(proc):
        copy_regular_files(proc, out)
        drop_runtime_keys(out)
    copy_source_files(source, out)


def copy_regular_files(src: str, dst: str) -> None:
    """Copy the regular files under ``src`` into ``dst``; symbolic links are skipped (with a
    warning), so nothing outside ``src`` is ever copied."""
    for base, dirs, files in os.walk(src):  # os.walk does not descend into linked folders
        rel = os.path.relpath(base, src)
        os.makedirs(os.path.join(dst, rel), exist_ok=True)
        for name in files + [x for x in dirs if os.path.islink(os.path.join(base, x))]:
            path = os.path.join(base, name)
            if os.path.islink(path) or not os.path.isfile(path):
                logger.warning("export: not copying %s (a symbolic link or not a regular file)", path)
                continue
            shutil.copyfile(path, os.path.join(dst, rel, name))


def _check_target(out_dir: str, overwrite: bool) -> None:
    if os.path.lexists(out_dir) and not overwrite and not (
            os.path.isdir(out_dir) and not os.path.islink(out_dir) and not os.listdir(out_dir)):
        raise FileExistsError(f"export target {out_dir} exists and is not empty; choose a new "
                              f"directory, or replace it with ray-dhp export --overwrite (Python: "
                              f"overwrite=True)")


@contextlib.contextmanager
def _staging(out_dir: str):
    """A fresh temporary directory beside ``out_dir``, renamed to ``out_dir`` when the block
    succeeds (an existing ``out_dir`` is moved aside first and deleted after), removed if not."""
    tmp = f"{out_dir}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = None
    if os.path.lexists(out_dir):
        old = f"{out_dir}.old-{os.getpid()}"
        os.replace(out_dir, old)
    os.replace(tmp, out_dir)
    if old is not None:
        if os.path.isdir(old) and not os.path.islink(old):
            shutil.rmtree(old)
        else:
            os.remove(old)
