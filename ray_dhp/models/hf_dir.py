"""The weights of a Hugging Face model directory, read one slice at a time (safetensors).

`HFDirectory` indexes ``model.safetensors`` or the shards named by
``model.safetensors.index.json`` from their headers only, maps checkpoint names to the model's
own parameter names with transformers' conversion mapping (Qwen2-VL / Qwen2.5-VL checkpoints
store ``visual.*`` / ``model.*``; the transformers 5 modules are ``model.visual.*`` /
``model.language_model.*``; tensors its converters build, such as fused or per-expert MoE
experts, are read slice by slice by `ray_dhp.models.hf_convert`), and checks, before anything is read, that every parameter is there
with the shape the config gives and a floating-point dtype. `read` then returns just the slice a
rank keeps, converted to the parameter's dtype; each read maps its file only for that read, so
the pages of other tensors never count against the process.
"""

from __future__ import annotations

import json
import logging
import os

import torch

logger = logging.getLogger(__name__)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype names ray_dhp converts from (anything else is quantized or not a weight).
FLOAT_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


class CheckpointError(ValueError):
    """A model directory that cannot be loaded into the model its config describes."""


def has_weights(path) -> bool:
    """True if ``path`` is a directory with safetensors weights ray_dhp can read."""
    p = os.fspath(path)
    return os.path.isfile(os.path.join(p, INDEX_FILE)) or os.path.isfile(os.path.join(p, SINGLE_FILE))


def weight_files(path: str) -> dict:
    """{checkpoint tensor name: file path} from the index (sharded) or the single file's header."""
    index = os.path.join(path, INDEX_FILE)
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index} has no 'weight_map'; re-save the model with save_pretrained")
        files = {k: os.path.join(path, v) for k, v in weight_map.items()}
        missing = sorted({v for v in files.values() if not os.path.isfile(v)})
        if missing:
            holds = {m: next(k for k, v in files.items() if v == m) for m in missing}
            raise CheckpointError(
                f"model directory {path}: {len(missing)} shard file(s) named in {INDEX_FILE} are "
                f"missing: " + ", ".join(f"{os.path.basename(m)} (holds e.g. {holds[m]})" for m in missing)
                + "; the download or copy is incomplete.")
        return files
    single = os.path.join(path, SINGLE_FILE)
    if not os.path.isfile(single):
        others = [n for n in os.listdir(path) if n.endswith((".bin", ".pt", ".pth"))]
        hint = f" (found {others[:3]}: convert them to safetensors)" if others else ""
        raise CheckpointError(f"model directory {path} has neither {SINGLE_FILE} nor {INDEX_FILE}{hint}")
    from safetensors import safe_open

    with safe_open(single, framework="pt") as f:
        return {k: single for k in f.keys()}


def _headers(files: dict) -> dict:
    """{checkpoint name: (shape, dtype name)} from the files' headers (no tensor data read)."""
    from safetensors import safe_open

    by_file: dict = {}
    for k, f in files.items():
        by_file.setdefault(f, []).append(k)
    out = {}
    for fname, keys in by_file.items():
        try:
            with safe_open(fname, framework="pt") as f:
                present = set(f.keys())
                for k in keys:
                    if k not in present:
                        raise CheckpointError(f"{fname} does not hold {k}, which {INDEX_FILE} places "
                                              f"there; the shard does not belong to this index")
                    s = f.get_slice(k)
                    out[k] = (tuple(s.get_shape()), s.get_dtype())
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - a truncated or foreign file
            raise CheckpointError(f"cannot read the safetensors header of {fname}: {e}") from e
    return out


class HFDirectory:
    """The tensors of one model directory, by the names of ``model`` (built on the meta device)."""

    def __init__(self, path, model: torch.nn.Module):
        self.path = os.path.abspath(os.fspath(path))
        files = weight_files(self.path)
        headers = _headers(files)
        targets = _model_names(model)
        self.source: dict = {}  # model name -> checkpoint name
        renamed, grouped = _rename(model, list(files), targets)
        for key, name in renamed.items():
            self.source.setdefault(name, key)
        self.converted = _converted(grouped, headers, targets)  # model name -> Converted
        used = set(self.source.values()) | {k for c in self.converted.values() for k in c.keys}
        self.files = {k: files[k] for k in used}
        self.headers = {k: headers[k] for k in used}
        unused = sorted(set(files) - used)
        if unused:
            logger.warning("%s: %d tensors match no parameter of the model (ignored), e.g. %s",
                           self.path, len(unused), unused[:3])
        self._check(model, targets)

    def holds(self, name: str) -> bool:
        return name in self.source or name in self.converted

    def key_of(self, names) -> str:
        """The checkpoint name for a parameter known under ``names`` (tied parameters: several)."""
        for n in names:
            if n in self.source:
                return self.source[n]
        raise CheckpointError(f"model directory {self.path} has no tensor for {names[0]}")

    def _check(self, model, targets: dict) -> None:
        groups: dict = {}
        for n, t in targets.items():
            groups.setdefault(t.untyped_storage()._cdata if t.is_meta else id(t), []).append(n)
        params = {n for n, _ in model.named_parameters(remove_duplicate=False)}
        missing = [names[0] for names in groups.values()
                   if names[0] in params and not any(self.holds(n) for n in names)]
        if missing:
            raise CheckpointError(
                f"model directory {self.path} lacks {len(missing)} parameter(s) the config describes, "
                f"e.g. {missing[:5]}; is it a checkpoint of this model (config.json) and complete?")
        for names in groups.values():
            conv = next((self.converted[n] for n in names if n in self.converted), None)
            if conv is None and not any(n in self.source for n in names):
                continue  # a buffer the model computes itself
            keys = conv.keys if conv is not None else [self.key_of(names)]
            shape = conv.shape if conv is not None else self.headers[keys[0]][0]
            want = tuple(targets[names[0]].shape)
            where = f"tensor {keys[0]} in {os.path.basename(self.files[keys[0]])} ({self.path})"
            if conv is not None and len(keys) > 1:
                where = f"tensors {keys[0]} .. {keys[-1]} ({len(keys)}, {self.path})"
            if shape != want:
                raise CheckpointError(f"{where} give(s) the shape {list(shape)} but the config gives "
                                      f"{names[0]} the shape {list(want)}; config.json and the "
                                      f"weights disagree")
            for key in keys:
                if self.headers[key][1] not in FLOAT_DTYPES:
                    raise CheckpointError(
                        f"tensor {key} in {os.path.basename(self.files[key])} ({self.path}) is stored "
                        f"as {self.headers[key][1]}; ray_dhp loads floating-point weights "
                        f"({', '.join(FLOAT_DTYPES)}): dequantize the model first")

    def read(self, names, slices: tuple, dtype: torch.dtype) -> torch.Tensor:
        """The slice ``slices`` of the tensor behind ``names``, as ``dtype`` (a fresh tensor)."""
        conv = next((self.converted[n] for n in names if n in self.converted), None)
        shape = conv.shape if conv is not None else self.headers[self.key_of(names)][0]
        out = torch.empty([s.stop - s.start for s in slices] if slices else shape, dtype=dtype)
        return self.read_into(names, slices, out)

    def read_into(self, names, slices: tuple, out: torch.Tensor) -> torch.Tensor:
        """Copy the slice ``slices`` of the tensor behind ``names`` into ``out`` (any dtype and
        device), with the file mapped only during the copy."""
        from contextlib import ExitStack

        from safetensors import safe_open

        conv = next((self.converted[n] for n in names if n in self.converted), None)
        if conv is not None:  # the files of its parts, each opened once for this copy
            with ExitStack() as stack:
                handles: dict = {}

                def open_file(key):
                    f = self.files[key]
                    if f not in handles:
                        handles[f] = stack.enter_context(safe_open(f, framework="pt"))
                    return handles[f]

                out.copy_(conv.read(open_file, slices))
            return out
        key = self.key_of(names)
        with safe_open(self.files[key], framework="pt") as f:
            out.copy_(f.get_slice(key)[slices] if slices else f.get_tensor(key))
        return out


def _model_names(model) -> dict:
    """Parameters (all names, tied ones too) and persistent buffers: what a checkpoint holds."""
    out = dict(model.named_parameters(remove_duplicate=False))
    persistent = set(model.state_dict(keep_vars=True))
    out.update({n: b for n, b in model.named_buffers(remove_duplicate=False) if n in persistent})
    return out


def _rename(model, keys: list, targets: dict):
    """({checkpoint name: model name} for every checkpoint name that names a model tensor, and
    {model name: (converter, [checkpoint names])} for those a `WeightConverter` of the model's
    registered transformers conversion mapping builds; `ray_dhp.models.hf_convert`)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    from ray_dhp.models.hf_convert import extra_converters

    mapping = get_model_conversion_mapping(model)
    renamings = [m for m in mapping if isinstance(m, WeightRenaming)]
    converters = [m for m in mapping if isinstance(m, WeightConverter)] + extra_converters(model)
    prefix = getattr(model, "base_model_prefix", None)
    out, grouped = {}, {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, prefix, targets)
        if name not in targets and key in targets:
            name, converted = key, None
        if name not in targets:
            continue
        if converted is None:
            out[key] = name
            continue
        conv = next(c for c in converters if converted in c.source_patterns)
        grouped.setdefault(name, (conv, []))[1].append(key)
    return out, grouped


def _converted(grouped: dict, headers: dict, targets: dict) -> dict:
    from ray_dhp.models.hf_convert import Unsupported, build

    out = {}
    for name, (conv, keys) in grouped.items():
        try:
            out[name] = build(name, conv, keys, {k: headers[k][0] for k in keys},
                              tuple(targets[name].shape))
        except Unsupported as e:
            raise CheckpointError(f"checkpoint tensor(s) {keys[:2]} need transformers' weight "
                                  f"conversion {conv.source_patterns!r} -> {conv.target_patterns!r}, "
                                  f"which sharded loading does not support ({e})") from e
    return out
