"""A generic family's vision activations measured on the meta device
(`ray_dhp.models.vision_saved`) are what the same ``get_image_features`` saves on CPU, and the
planner takes them for the block formula (`ray_dhp.planning.memory_vision`)."""

import inspect

import pytest
import torch


def _cpu_saved(config, family) -> int:
    """Bytes the CPU forward saves for backward (storages once, parameters excluded)."""
    import transformers

    from ray_dhp.models.generic_probe import root_of
    from ray_dhp.models.vision_saved import _inputs, _is_param

    cls = getattr(transformers, family.model_class)
    root = root_of(cls._from_config(config, dtype=torch.float32))
    seen, total = set(), [0]

    def pack(t):
        if not _is_param(t) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total[0] += t.untyped_storage().nbytes()
        return t

    kwargs, tokens = _inputs(family, root, config.vision_config,
                             tuple(inspect.signature(cls.get_image_features).parameters))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        root.get_image_features(**kwargs, return_dict=True)
    return total[0], tokens


def test_meta_probe_matches_cpu_and_feeds_the_plan():
    from ray_dhp import demo
    from ray_dhp.models import family_of, vision_saved_per_token
    from ray_dhp.planning.memory import ActivationSettings
    from ray_dhp.planning.memory_vision import vision_activation_parts

    config = demo.tiny_model_config("paligemma")
    layers, rest = vision_saved_per_token(config, 4)
    cpu, tokens = _cpu_saved(config, family_of(config))
    assert layers > 0 and rest > 0
    assert (layers + rest) * tokens == pytest.approx(cpu, rel=1e-9)
    bf16 = vision_saved_per_token(config, 2)
    assert sum(bf16) < 0.75 * (layers + rest)  # the meta model built in bf16
    vc, s = config.vision_config, ActivationSettings(4, "flash", False)
    assert vision_activation_parts(vc, 2 * tokens, 1, s, tokens, config) == pytest.approx(
        (2 * tokens * (layers + rest), 0.0))
    # a hand-written family keeps its block formula
    assert vision_saved_per_token(demo.tiny_model_config("qwen2_5_vl"), 4) is None


def test_meta_probe_runs_where_the_tower_reads_values_sent_to_its_device():
    """MiniCPM-V 4.6's tower sends its window lengths (from ``target_sizes``) to the hidden
    states' device and reads them (``.tolist()``): kept on CPU there, the probe runs and saves
    what the CPU forward saves."""
    from ray_dhp import demo
    from ray_dhp.models import family_of, vision_saved_per_token

    config = demo.tiny_model_config("minicpmv4_6")
    layers, rest = vision_saved_per_token(config, 4)
    cpu, tokens = _cpu_saved(config, family_of(config))
    assert layers > 0 and (layers + rest) * tokens == pytest.approx(cpu, rel=1e-9)
