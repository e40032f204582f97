"""The generic family (`ray_dhp.models.generic`) reads what it needs from the model itself, and
the sharded random init reproduces the models it admits bit for bit."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model, family_of
from ray_dhp.models.generic import GenericFamily
from ray_dhp.models.loading import build_meta_model


def test_gemma3_is_read_from_its_own_metadata():
    config = demo.tiny_model_config("gemma3")
    family = family_of(config)
    assert isinstance(family, GenericFamily) and family.model_class == "Gemma3ForConditionalGeneration"
    assert family.vision_parts == ("vision_tower", "multi_modal_projector")
    assert family.merger_prefixes == ("model.multi_modal_projector.",)
    # 4x4 patches pooled to mm_tokens_per_image=4 rows: 2x2 patches a row
    assert (family.rows_per_image, family.merge_size(config)) == (4, 2)
    # base_model_tp_plan's replicated_with_grad_allreduce: the per-head norms' partial gradients
    assert family.tp_partial_grad_suffixes == ("self_attn.q_norm.weight", "self_attn.k_norm.weight")
    assert "token_type_ids" in family.lm_inputs(config, {"mm_token_type_ids": torch.tensor([[0, 1]]),
                                                         "image_grid_thw": None})
    assert "image_grid_thw" not in family.lm_inputs(config, {"image_grid_thw": None})


def test_llava_holds_the_tower_layer_it_never_reads_frozen():
    """LLaVA takes the features of the tower's second-to-last layer: the last layer gets no
    gradient (a meta backward finds it), so the engine holds it frozen as AdamW skips it."""
    family = family_of(demo.tiny_model_config("llava"))
    unused = family.vision_encoder.unused
    assert unused and all(n.startswith(("vision_tower.encoder.layers.1.",
                                        "vision_tower.post_layernorm.")) for n in unused)


def test_vision_sequence_parallel_is_read_from_the_towers_code():
    """CLIP's layers call attention through transformers' interface: SP2 is admitted (its fp64
    parity: the generic rows' collocated-sp2-tp2); GLM-4V's attention splits its tokens per
    image itself: refused in the driver, naming why."""
    config = demo.tiny_model_config("llava")
    family_of(config).validate_layout(config, sp=2, tp=1)
    config = demo.tiny_model_config("glm4v")
    with pytest.raises(ValueError, match="sequence_parallel=2 is not covered.*splits the tokens per image"):
        family_of(config).validate_layout(config, sp=2, tp=1)


def test_an_unsupported_type_is_refused_naming_why():
    from transformers import AutoConfig

    with pytest.raises(ValueError, match="model_type 'bert' is not supported"):
        family_of(AutoConfig.for_model("bert"))


@pytest.mark.parametrize("family", ["gemma3", "llava"])
def test_sharded_random_init_replays_the_stock_init(family):
    """SigLIP's trunc_normal_ init (rejection sampling: a no-op on meta) and CLIP's
    ``nn.Parameter(torch.randn(d))`` class embedding are replayed: every parameter equals the
    stock ``_from_config``'s, bit for bit."""
    config = demo.tiny_model_config(family)
    ref = dict(build_model(config, seed=3, dtype=torch.float64).named_parameters())
    meta = build_meta_model(config, seed=3, dtype=torch.float64)
    got = {}
    meta.init.replay(3, set(meta.init.params), lambda names, t: got.update({n: t for n in names}))
    assert set(got) == set(ref)
    assert all(torch.equal(got[n], ref[n].detach()) for n in ref)


@pytest.mark.slow
def test_a_navit_strip_is_laid_out_as_the_family_processor_lays_it():
    """MiniCPM-V 4.6's tower takes one strip of every image's patches with ``target_sizes``
    (`packed_inputs`): from ray_dhp's patch rows it is exactly what transformers' own image
    processor of the family makes of the same images (two sizes, no resize or normalisation)."""
    import numpy as np
    from PIL import Image
    from transformers.models.minicpmv4_6.image_processing_pil_minicpmv4_6 import (
        MiniCPMV4_6ImageProcessorPil)

    from ray_dhp.data.tiles import tile_rows
    from ray_dhp.models.generic_probe import packed_inputs

    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((56, 84), (112, 56))]
    out = MiniCPMV4_6ImageProcessorPil(slice_mode=False)(
        images=[Image.fromarray(a) for a in images], return_tensors="pt", do_resize=False,
        do_rescale=False, do_normalize=False)
    rows = torch.cat([tile_rows(torch.tensor(a, dtype=torch.float32).permute(2, 0, 1)[None], 14)
                      for a in images])
    grid = torch.tensor([[1, a.shape[0] // 14, a.shape[1] // 14] for a in images])
    ours = packed_inputs(rows, grid, 14, 3)
    assert torch.equal(ours["pixel_values"], out["pixel_values"].float())
    assert torch.equal(ours["target_sizes"], out["target_sizes"])


def test_patch_positions_are_laid_out_as_gemma4s_processor_lays_them():
    """Gemma 4's tower takes each image's patch rows padded to the longest with each patch's
    ``(x, y)`` (``image_position_ids``, -1 on padding; `padded_inputs`): from ray_dhp's patch
    rows it is what transformers' own image processor makes of the same images (two sizes, no
    resize or rescale), up to the processor's longer padding; each image's soft tokens are its
    patches over the 3x3 pooling, as the processor counts them."""
    import numpy as np
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    from ray_dhp.data.tiles import tile_rows
    from ray_dhp.models.generic_probe import padded_input, padded_inputs

    from transformers import Gemma4ForConditionalGeneration

    assert padded_input(Gemma4ForConditionalGeneration)
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((48, 96), (96, 48))]
    out = Gemma4ImageProcessorPil(patch_size=16, max_soft_tokens=70)(
        images=[Image.fromarray(a) for a in images], return_tensors="pt", do_resize=False,
        do_rescale=False)
    rows = torch.cat([tile_rows(torch.tensor(a, dtype=torch.float32).permute(2, 0, 1)[None], 16)
                      for a in images])
    grid = torch.tensor([[1, a.shape[0] // 16, a.shape[1] // 16] for a in images])
    ours = padded_inputs(("image_position_ids",), rows, grid, 16, 3)
    n = ours["pixel_values"].shape[1]
    assert "spatial_shapes" not in ours
    assert torch.equal(ours["pixel_values"], out["pixel_values"][:, :n].float())
    assert torch.equal(ours["image_position_ids"], out["image_position_ids"][:, :n].long())
    assert (out["image_position_ids"][:, n:] == -1).all()
    assert (grid.prod(-1) // 9).tolist() == out["num_soft_tokens_per_image"].tolist()


def test_gemma4_is_read_from_its_own_metadata():
    """Gemma 4's tower goes the padded route (``image_position_ids``; its 3x3 pooling read from
    the probe's rows), its heterogeneous text config shrinks layer by layer (the full-attention
    layer's wider heads), and the read of its embedding table's pad row outside the embedding
    is found (served row by row under text TP / ZeRO-3: `ray_dhp.parallel.table_rows`)."""
    from ray_dhp.models.generic_probe import probe
    from transformers import Gemma4ForConditionalGeneration

    config = demo.tiny_model_config("gemma4")
    text = config.get_text_config()
    assert text.per_layer_config[1].head_dim == 2 * text.per_layer_config[0].head_dim == 32
    assert config.vision_config.num_key_value_heads == config.vision_config.num_attention_heads
    pooled, *_, side = probe(config, Gemma4ForConditionalGeneration, padded=True)
    assert side == 12 and sum(p.shape[0] for p in pooled) == (12 // 3) ** 2
    family = family_of(config)
    assert family.padded_input and family.merge_size(config) == 3
    assert family.image_kwargs == ("image_position_ids",)
    assert family.text_reads_table == "Gemma4Model.forward"
    assert family.vision_parts == ("vision_tower", "embed_vision") and not family.vision_sp_refusal
