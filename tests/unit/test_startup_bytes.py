"""The 32B preset at TP=8: the engine of one rank, built on the meta device, holds exactly the
parameter bytes ``count_params`` (the model `ray-dhp plan` uses) gives that rank."""

import pytest

from ray_dhp.cli.models import config_from_dims
from ray_dhp.cli.presets import preset_dims
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.startup import meta_engine, rank_parameter_bytes
from ray_dhp.parallel.topology import Topology


@pytest.mark.parametrize("placement, rank", [("collocated", 5), ("disjoint", 2)])
def test_32b_rank_bytes_on_meta_match_the_count(placement, rank):
    config = config_from_dims(preset_dims("qwen2_5_vl", "32b"), "qwen2_5_vl")
    v = (1, 8) if placement == "collocated" else (2, 1)   # (sp, dp)
    topo = Topology.build(placement=placement, vision_sp=v[0], vision_dp=v[1], text_tp=8, text_dp=1)
    got = rank_parameter_bytes(config, topo, rank)
    counts = count_params(config)
    is_vision, is_text = topo.vision.coord(rank) is not None, topo.text.coord(rank) is not None
    assert got["vision"] == (counts.vision * 4 if is_vision else 0)
    assert got["text"] == (counts.text_per_rank(8) * 4 if is_text else 0)
    assert got["total"] == got["vision"] + got["text"] > 0


def test_meta_engine_holds_no_memory():
    import torch

    config = config_from_dims(preset_dims("qwen2_5_vl", "7b"), "qwen2_5_vl")
    topo = Topology.build(placement="collocated", vision_sp=2, vision_dp=1, text_tp=2, text_dp=1)
    engine = meta_engine(config, topo, 1)
    params = list(engine.visual.parameters()) + list(engine.text_model.parameters())
    assert params and all(p.is_meta for p in params)
    assert engine.text_model.lm_head.weight.to_local().shape == (152064 // 2, 3584)
    assert isinstance(engine.vision_params[0], torch.nn.Parameter)


def test_tied_7b_dims_on_meta_hold_one_embedding_and_plan_counts_it_once():
    """``tie_word_embeddings=True`` (as Qwen2.5-VL-3B) at TP=4: the meta-built text rank holds one
    vocab-sharded weight for the embedding and ``lm_head`` (the same Parameter), and its bytes
    equal `count_params`' for that rank, which is the untied count less one V x H matrix."""
    dims = preset_dims("qwen2_5_vl", "7b")
    untied = count_params(config_from_dims(dims, "qwen2_5_vl"))
    dims["tie_word_embeddings"] = dims["text_config"]["tie_word_embeddings"] = True
    config = config_from_dims(dims, "qwen2_5_vl")
    counts = count_params(config)
    vh = config.text_config.vocab_size * config.text_config.hidden_size
    assert (counts.text, counts.text_sharded) == (untied.text - vh, untied.text_sharded - vh)
    topo = Topology.build(placement="disjoint", vision_sp=1, vision_dp=1, text_tp=4, text_dp=1)
    engine = meta_engine(config, topo, 1)
    lm = engine.text_model.model.language_model
    assert engine.text_model.lm_head.weight is lm.embed_tokens.weight
    assert rank_parameter_bytes(config, topo, 1)["text"] == counts.text_per_rank(4) * 4
