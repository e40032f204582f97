"""Meta-device construction and materialisation on one process (no process group).

* Random init replayed one parameter at a time equals ``build_model`` (the reference's
  ``_from_config``) bit for bit, for every family and in fp32 and fp64, buffers included.
* A Hugging Face directory (single file or really sharded by ``max_shard_size``; legacy
  ``visual.*`` / ``model.*`` checkpoint names) loads to exactly what ``from_pretrained`` gives,
  with dtype conversion on the fly.
* Bad directories fail while building, naming the file or tensor: a missing shard, a shape that
  disagrees with the config, a dtype that is not a floating-point weight, a missing tensor.
"""

import json
import os

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.models.hf_dir import INDEX_FILE, CheckpointError
from ray_dhp.models.loading import build_meta_model, local_parameter_bytes, materialize


def _materialized(model, seed=0, dtype=torch.float32):
    meta = build_meta_model(model, seed=seed, dtype=dtype)
    assert all(p.is_meta for p in meta.module.parameters())
    materialize(meta, {"": meta.module}, "cpu")
    return meta.module


def _assert_identical(got, ref):
    g, r = dict(got.named_parameters()), dict(ref.named_parameters())
    assert set(g) == set(r), set(g) ^ set(r)
    for n in r:
        assert g[n].dtype == r[n].dtype and torch.equal(g[n], r[n]), n
    gb, rb = dict(got.named_buffers()), dict(ref.named_buffers())
    assert set(gb) == set(rb)
    for n in rb:
        assert gb[n].dtype == rb[n].dtype and torch.equal(gb[n], rb[n]), n


@pytest.mark.parametrize("family,dtype", [("qwen2_5_vl", torch.float32), ("qwen2_5_vl", torch.float64),
                                          ("qwen2_vl", torch.float32), ("qwen3_vl", torch.float64),
                                          ("qwen3_5", torch.float64)])
def test_random_init_is_bit_identical_to_the_reference(family, dtype):
    got = _materialized(demo.tiny_model_config(family), seed=7, dtype=dtype)
    _assert_identical(got, build_model(demo.tiny_model_config(family), seed=7, dtype=dtype))


def test_a_temporary_draw_copied_into_a_parameter_is_replayed():
    """Qwen3.5's ``A_log``: drawn into a scratch tensor in ``__init__`` (a real CPU tensor) and
    again in ``_init_weights`` (on the parameter's device, then ``log_`` and copied in); both
    draws advance the generator, the second one's value is the parameter's."""
    ref = build_model(demo.tiny_model_config("qwen3_5"), seed=3)
    got = _materialized(demo.tiny_model_config("qwen3_5"), seed=3)
    a = "model.language_model.layers.0.linear_attn.A_log"
    assert torch.equal(dict(got.named_parameters())[a], dict(ref.named_parameters())[a])
    assert not torch.equal(ref.get_parameter(a), torch.zeros_like(ref.get_parameter(a)))


class _ScratchThenParameter(torch.nn.Module):
    """A freed meta scratch tensor followed by a new parameter of the same size: the allocator
    hands the new parameter's storage the scratch's address (what happened to Qwen3.5's
    ``A_log`` scratch and ``lm_head.weight`` in about one construction of 30)."""

    def __init__(self, n=8, repeats=16):
        super().__init__()
        for i in range(repeats):
            setattr(self, f"a{i}", torch.nn.Parameter(torch.empty(n)))
            a = getattr(self, f"a{i}")
            with torch.no_grad():
                scratch = torch.empty(n, device=a.device).uniform_(0.01, 16).log_()
                a.copy_(scratch)
            del scratch
            setattr(self, f"b{i}", torch.nn.Parameter(torch.empty(n)))
            torch.nn.init.normal_(getattr(self, f"b{i}"))


def test_a_freed_scratch_address_reused_by_a_later_parameter_is_not_that_parameter():
    from ray_dhp.models.meta_init import construct_recorded

    torch.manual_seed(5)
    ref = _ScratchThenParameter()
    model, record = construct_recorded(_ScratchThenParameter)
    got = {}
    record.replay(5, set(record.params), lambda names, t: got.update({n: t for n in names}))
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p), n


def test_only_wanted_parameters_are_materialised():
    meta = build_meta_model(demo.tiny_model_config(), seed=1)
    visual = meta.module.model.visual
    materialize(meta, {"model.visual.": visual}, "cpu")
    assert not any(p.is_meta for p in visual.parameters())
    assert all(p.is_meta for n, p in meta.module.named_parameters() if not n.startswith("model.visual."))
    ref = build_model(demo.tiny_model_config(), seed=1)
    for n, p in visual.named_parameters():
        assert torch.equal(p, ref.get_parameter("model.visual." + n)), n
    assert local_parameter_bytes(visual) == sum(p.numel() * 4 for p in ref.model.visual.parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny model saved twice: one file, and sharded into several files."""
    root = tmp_path_factory.mktemp("hf")
    model = build_model(demo.tiny_model_config(), seed=3)
    model.save_pretrained(root / "single")
    model.save_pretrained(root / "sharded", max_shard_size="100KB")
    return root


def test_directory_is_really_sharded_with_legacy_names(saved):
    index = json.loads((saved / "sharded" / INDEX_FILE).read_text())["weight_map"]
    assert len(set(index.values())) > 3
    assert any(k.startswith("visual.") for k in index) and any(k.startswith("model.layers.") for k in index)


@pytest.mark.parametrize("layout", ["single", "sharded"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_directory_loads_like_from_pretrained(saved, layout, dtype):
    path = str(saved / layout)
    _assert_identical(_materialized(path, dtype=dtype), build_model(path, dtype=dtype))


def test_directory_slices_are_read_per_tensor(saved):
    meta = build_meta_model(str(saved / "sharded"))
    ref = build_model(str(saved / "sharded"))
    name = "model.language_model.layers.0.mlp.down_proj.weight"
    part = meta.directory.read([name], (slice(0, 64), slice(64, 128)), torch.float64)
    assert part.shape == (64, 64) and part.dtype == torch.float64
    assert torch.equal(part, ref.get_parameter(name)[:, 64:128].double())


def _copy_dir(src, dst):
    os.makedirs(dst)
    for n in os.listdir(src):
        with open(os.path.join(src, n), "rb") as f, open(os.path.join(dst, n), "wb") as g:
            g.write(f.read())
    return dst


def test_missing_shard_names_the_file(saved, tmp_path):
    d = _copy_dir(saved / "sharded", tmp_path / "m")
    index = json.loads((tmp_path / "m" / INDEX_FILE).read_text())["weight_map"]
    gone = sorted(set(index.values()))[1]
    os.remove(os.path.join(d, gone))
    with pytest.raises(CheckpointError, match=f"{gone}.*holds e.g."):
        build_meta_model(str(d))


def _rewrite(path, key, tensor):
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    tensors[key] = tensor
    save_file(tensors, path, metadata={"format": "pt"})


def test_shape_that_disagrees_with_the_config_names_the_tensor(saved, tmp_path):
    d = _copy_dir(saved / "single", tmp_path / "s")
    _rewrite(os.path.join(d, "model.safetensors"), "model.layers.1.mlp.up_proj.weight", torch.zeros(8, 64))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight in model\.safetensors"
                                              r".*shape \[8, 64\].*\[128, 64\]"):
        build_meta_model(d)


def test_non_float_dtype_names_the_tensor(saved, tmp_path):
    d = _copy_dir(saved / "single", tmp_path / "q")
    _rewrite(os.path.join(d, "model.safetensors"), "visual.blocks.0.attn.qkv.weight",
             torch.zeros(96, 32, dtype=torch.int8))
    with pytest.raises(CheckpointError, match=r"visual\.blocks\.0\.attn\.qkv\.weight.*stored as I8"):
        build_meta_model(d)


def test_missing_tensor_and_missing_weights(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy_dir(saved / "single", tmp_path / "t")
    f = os.path.join(d, "model.safetensors")
    tensors = load_file(f)
    del tensors["lm_head.weight"]
    save_file(tensors, f, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"lacks 1 parameter.*lm_head\.weight"):
        build_meta_model(d)
    os.remove(f)
    with pytest.raises(CheckpointError, match="neither model.safetensors nor"):
        build_meta_model(d)


def test_integer_model_dtype_is_refused():
    with pytest.raises(ValueError, match="not a floating-point dtype"):
        build_meta_model(demo.tiny_model_config(), dtype=torch.int32)


def test_driver_rejects_a_directory_with_a_missing_shard(saved, tmp_path):
    """`DHPConfig` (the driver, before any worker starts) checks the weights' headers."""
    from ray_dhp.layout import DHPConfig

    assert DHPConfig(model=str(saved / "sharded")).model == str(saved / "sharded")
    d = _copy_dir(saved / "sharded", tmp_path / "d")
    gone = sorted(n for n in os.listdir(d) if n.endswith(".safetensors"))[0]
    os.remove(os.path.join(d, gone))
    with pytest.raises(CheckpointError, match=gone):
        DHPConfig(model=d)
