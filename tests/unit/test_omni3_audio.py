"""Qwen3-Omni's audio tower as an encoder module (`ray_dhp.models.audio_omni`): the pads the data
side writes per clip are the rows the stock tower makes of it, and an audio replica holding some
of a micro-batch's clips makes exactly their rows of the stock forward over the whole batch (its
chunks padded as the batch pads them: without it, a clip's last, shorter chunk comes out
different, the negative control below). fp64; the rows compared to 1e-12 relative (the same
operations on differently shaped batches: only summation orders may differ)."""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.reading import read_annotations, resolve_data_root
from ray_dhp.demo.audio import make_audio_dataset
from ray_dhp.models import FAMILIES, build_model
from ray_dhp.models import audio_omni as ops

FAMILY = FAMILIES["qwen3_omni_moe"]


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    """Samples of one clip each (0.6 s, 1.0 s, 2.3 s: one short chunk, one whole chunk, two whole
    chunks and a tail), the tiny thinker in fp64 and its stock rows of the whole batch."""
    path = make_audio_dataset(tmp_path_factory.mktemp("a3") / "set", num_samples=3,
                              seconds=(0.6, 1.0, 2.3))
    proc = demo.tiny_processor("qwen3_omni_moe")
    samples = [proc.process(r, resolve_data_root(path)) for r in read_annotations(path)]
    config = demo.tiny_model_config("qwen3_omni_moe")
    model = build_model(config, dtype=torch.float64).eval()
    batch = ops.inputs(samples)
    with torch.no_grad():
        stock = model.get_audio_features(batch["input_features"].double(),
                                         batch["feature_attention_mask"]).last_hidden_state
    return samples, config, model, stock


def test_pads_are_the_stock_rows(clips):
    """Each sample's audio pads = transformers' row count of its clip = the rows the stock tower
    makes of it alone."""
    from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import (
        _get_feat_extract_output_lengths)

    samples, config, model, stock = clips
    assert [s.audio_lengths.tolist() for s in samples] == [[60], [100], [230]]
    for s in samples:
        pads = int((s.mm_token_type_ids == 3).sum())
        alone = ops.inputs([s])
        with torch.no_grad():
            rows = model.get_audio_features(alone["input_features"].double(),
                                            alone["feature_attention_mask"]).last_hidden_state
        assert pads == int(_get_feat_extract_output_lengths(s.audio_lengths).sum()) == rows.shape[0]
    assert stock.shape[0] == sum(ops.rows(FAMILY, config, s) for s in samples) == 8 + 13 + 30


@pytest.mark.parametrize("mine", [(0,), (0, 1), (2,)])
def test_a_replica_makes_its_rows_of_the_whole_batch(clips, mine):
    samples, config, model, stock = clips
    offsets = torch.tensor([0] + [ops.rows(FAMILY, config, s) for s in samples]).cumsum(0)
    want = torch.cat([stock[offsets[i]:offsets[i + 1]] for i in mine])
    part = [samples[i] for i in mine]
    plan = ops.plan(FAMILY, config, part, 1, micro_batch=samples)
    with torch.no_grad():
        got = ops.forward(FAMILY, model.model.audio_tower, ops.inputs(part), plan, torch.float64)
        alone = ops.forward(FAMILY, model.model.audio_tower, ops.inputs(part),
                            ops.plan(FAMILY, config, part, 1), torch.float64)
    assert plan == 100 and got.shape == want.shape
    assert float((got - want).norm() / want.norm()) < 1e-12
    if max(s.audio_lengths.max() for s in part) < 100:  # negative control: padded as alone
        assert float((alone - want).norm() / want.norm()) > 1e-6
