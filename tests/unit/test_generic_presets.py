"""Presets of published generic-family sizes (`ray_dhp.cli.presets`): the meta-device parameter
counts are the released models' sizes, and `ray-dhp plan` sizes its default sample as one image
of a fixed-size tower (`FamilySpec.image_patches`)."""

import pytest

from ray_dhp.cli.presets import preset_dims


_SLOW = pytest.mark.slow  # meta builds of 12-27B models: seconds each; one size per family runs by default


@pytest.mark.parametrize("family, preset, billions", [
    ("gemma3", "4b", 4.30), pytest.param("gemma3", "12b", 12.19, marks=_SLOW),
    pytest.param("gemma3", "27b", 27.43, marks=_SLOW),
    ("llava", "1.5-7b", 7.06), pytest.param("llava", "1.5-13b", 13.35, marks=_SLOW),
    pytest.param("mistral3", "24b", 24.01, marks=_SLOW), ("idefics3", "8b", 8.46), ("glm4v", "9b", 10.29),
])
def test_generic_presets_have_the_published_sizes(family, preset, billions):
    """Totals as the model cards give them (Gemma 3 4.3B/12.2B/27.4B with tied embeddings,
    LLaVA-1.5 7.06B/13.4B, Mistral Small 3.1 24.0B with untied ones, Idefics3-8B 8.46B,
    GLM-4.1V-9B 10.3B)."""
    from transformers import AutoConfig

    from ray_dhp.models import family_of
    from ray_dhp.models.sizes import count_params

    dims = preset_dims(family, preset)
    config = AutoConfig.for_model(dims.pop("model_type"), **dims)
    assert family_of(config).name == family  # the generic family reads it
    counts = count_params(config)
    assert round((counts.vision + counts.text) / 1e9, 2) == billions


def test_plan_defaults_to_one_image_of_a_fixed_size_tower(tmp_path, capsys):
    """LLaVA-1.5's CLIP tower takes 336-px images: 576 patches (and as many LM rows), not the
    4096 patches of the dynamic-resolution default."""
    from ray_dhp.cli import main

    run = tmp_path / "run.yaml"
    run.write_text("model: {family: llava, preset: 1.5-7b}\nvision: {data_parallel: 2}\n"
                   "text: {tensor_parallel: 2}\nplacement: collocated\n"
                   "optim: {global_batch_size: 2}\nscaling: {accelerator: h100, use_gpu: true}\n")
    assert main(["plan", str(run)]) == 0
    out = capsys.readouterr().out
    assert "vision tokens per sample = 576:" in out and "= 4096" not in out
