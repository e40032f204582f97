"""Can this run load a checkpoint: its format version, family, per-module choices and model."""

from __future__ import annotations

import json

FORMAT_VERSION = 3  # one format: the file list with XXH3-128 checksums per file / shard item


def check_compatible(meta: dict, engine) -> None:
    version = meta.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(f"checkpoint format version {version!r} is not the one this ray_dhp "
                         f"reads ({FORMAT_VERSION}); use the ray_dhp version that wrote it.")
    if meta.get("family") != engine.family.name:
        raise ValueError(f"checkpoint holds a {meta.get('family')} model but this run trains a "
                         f"{engine.family.name} model; use DHPConfig(model=...) of the same family.")
    from ray_dhp.config.tuning import same_structure

    why = same_structure(meta.get("modules"), engine.cfg.optim.modules)
    if why:
        raise ValueError(f"checkpoint was trained with modules={meta.get('modules')!r}, this run "
                         f"has modules={engine.cfg.optim.modules!r}: {why}; resume with the run's "
                         f"optim.modules (train_loop_config['modules']).")



# config keys that do not change what the weights mean (names, runtime switches, dropout rates)
_CONFIG_BENIGN = ("_name_or_path", "transformers_version", "architectures", "dtype", "torch_dtype",
                  "use_cache", "attn_implementation", "output_attentions", "output_hidden_states",
                  "return_dict", "initializer_range", "problem_type")


def _first_difference(a, b, key: str = ""):
    """``(dotted key, a value, b value)`` of the first difference of two JSON trees, or None."""
    if isinstance(a, dict) and isinstance(b, dict):
        for k in sorted(set(a) | set(b)):
            if k.startswith("_") or k in _CONFIG_BENIGN or "dropout" in k:
                continue
            d = _first_difference(a.get(k), b.get(k), f"{key}.{k}" if key else k)
            if d is not None:
                return d
        return None
    return None if a == b else (key, a, b)


def check_same_model(meta: dict, engine) -> None:
    """The stored model config must describe the model being trained (DCP would load a deeper
    checkpoint into a shallower model without complaint)."""
    stored = meta.get("model_config")
    if stored is None:
        return
    here = json.loads(engine.config.to_json_string(use_diff=False))
    diff = _first_difference(json.loads(stored), here)
    if diff is not None:
        key, was, now = diff
        raise ValueError(f"the checkpoint was written for another model: model config {key} is "
                         f"{was!r} in the checkpoint but {now!r} in this run; resume with the "
                         f"model it was trained with (or export it and start a new run from that "
                         f"directory)")
