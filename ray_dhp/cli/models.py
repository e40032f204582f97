"""Turn the run file's ``model`` section into what `DHPConfig(model=...)` takes."""

from __future__ import annotations

import copy

from ray_dhp.cli.schema import ConfigError


def _merge(base: dict, over: dict) -> dict:
    """Deep merge of two config dicts (``over`` wins)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def config_from_dims(dims: dict, family=None):
    """A transformers config from a dict of dims (``model_type`` or ``family`` names the class)."""
    from transformers import AutoConfig

    dims = dict(dims)
    model_type = dims.pop("model_type", None) or family
    if not model_type:
        raise ConfigError("model.config: say which model it is with model.family (e.g. "
                          "qwen2_5_vl) or a model_type key.")
    try:
        config = AutoConfig.for_model(model_type, **dims)
    except (ValueError, TypeError, KeyError) as e:
        raise ConfigError(f"model.config: transformers rejected it: {e}") from None
    for sub in (config, getattr(config, "text_config", None), getattr(config, "vision_config", None)):
        if sub is not None and getattr(sub, "dtype", None) is None:
            sub.dtype = "float32"
    return config


def build_model_spec(section):
    """A transformers config (demo / preset / inline dims) or an absolute local directory.

    Precedence: ``path``, then ``preset`` and/or ``config``, then ``demo``.
    """
    if section.path:
        if section.preset or section.config is not None:
            raise ConfigError("model: give either path (a local model directory) or "
                              "preset/config (dims without weights), not both.")
        from ray_dhp.models.hub import resolve_model_path

        try:  # a local directory or a Hub id (org/name) in the Hugging Face cache
            return resolve_model_path(section.path, "model.path")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if section.preset or section.config is not None:  # ``config: {}`` = the family's defaults
        dims = {}
        if section.preset:
            from ray_dhp.cli.presets import preset_dims

            if not section.family:
                raise ConfigError("model.preset needs model.family (e.g. family: qwen2_5_vl).")
            try:
                dims = preset_dims(section.family, section.preset)
            except ValueError as e:
                raise ConfigError(str(e)) from None
        return config_from_dims(_merge(dims, section.config or {}), section.family)
    if section.demo:
        from ray_dhp import demo

        try:
            return demo.tiny_model_config(section.demo)
        except ValueError as e:
            raise ConfigError(f"model.demo: {e}") from None
    raise ConfigError("model: set one of demo, path, family + preset, or config.")
