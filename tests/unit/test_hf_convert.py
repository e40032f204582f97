"""MoE checkpoints read slice by slice through transformers' conversion mapping
(`ray_dhp.models.hf_convert`), no ranks: any slice of a fused expert tensor read from the
``save_pretrained`` layout, the Hub's transposed layout or per-expert tensors equals the same
slice of the model's parameter (bit for bit); a malformed per-expert checkpoint names a tensor."""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.models.hf_dir import CheckpointError
from ray_dhp.models.loading import build_meta_model
from tests.distributed.moe_forms import INTER, _rewrite, hub_fused, per_expert


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfconv")
    config = demo.tiny_model_config("qwen3_vl_moe")
    config.text_config.moe_intermediate_size = INTER
    model = build_model(config, seed=4)
    fused = str(root / "fused")
    model.save_pretrained(fused, max_shard_size="100KB")
    return model, {"fused": fused, "hub": _rewrite(fused, str(root / "hub"), hub_fused),
                   "per_expert": _rewrite(fused, str(root / "per_expert"), per_expert)}


@pytest.mark.parametrize("form", ["fused", "hub", "per_expert"])
def test_every_slice_reads_as_the_parameter(form, saved):
    model, dirs = saved
    directory = build_meta_model(dirs[form]).directory
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n]
    assert experts and set(experts) <= set(directory.converted)
    # a slice across the gate/up boundary of gate_up_proj (rows INTER-3 .. INTER+5)
    cut = (slice(1, 5), slice(INTER - 3, INTER + 5), slice(2, 9))
    for n, p in model.named_parameters():
        want = p.detach()
        assert torch.equal(directory.read([n], (), p.dtype), want), n
        if n in experts:
            assert torch.equal(directory.read([n], cut, p.dtype), want[cut]), n


def test_a_per_expert_tensor_of_another_shape_is_named(saved, tmp_path):
    model, dirs = saved
    bad = "model.language_model.layers.0.mlp.experts.3.up_proj.weight"
    path = _rewrite(dirs["per_expert"], str(tmp_path / "bad"),
                    lambda k, v: [(k, v[:-1] if k == bad else v)])
    with pytest.raises(CheckpointError, match="experts.3.up_proj"):
        build_meta_model(path)


def test_qwen3_5_moe_save_pretrained_directory_reads_as_the_model(tmp_path):
    """transformers 5.24 saves Qwen3.5-MoE's experts per expert (``mlp.experts.<e>.gate_proj``);
    the directory is read through the same conversion mapping, every tensor bit for bit."""
    model = build_model(demo.tiny_model_config("qwen3_5_moe"), seed=5)
    model.save_pretrained(str(tmp_path), max_shard_size="200KB")
    directory = build_meta_model(str(tmp_path)).directory
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n]
    assert experts and set(experts) <= set(directory.converted)
    for n, p in model.named_parameters():
        assert torch.equal(directory.read([n], (), p.dtype), p.detach()), n
