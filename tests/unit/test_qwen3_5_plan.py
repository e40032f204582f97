"""Qwen3.5's Gated DeltaNet under TP, without a process group: the channels `segment_index`
gives a rank out of the fused ``[q | k | v]`` projection are exactly the query/key channels of
its key heads and the value channels of its value heads (what the conv and the recurrence of
that rank must see), and a plain contiguous split is not; the layout checks name what to change."""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import FAMILIES, build_model
from ray_dhp.parallel.channels import segment_index


def _heads(x, head_dim):
    return x.reshape(*x.shape[:-1], -1, head_dim)


@pytest.mark.parametrize("tp", [2, 4])
def test_each_rank_gets_its_heads_q_k_v_channels(tp):
    model = build_model(demo.tiny_model_config("qwen3_5"), seed=0)
    la = model.model.language_model.layers[0].linear_attn
    x = torch.randn(1, 5, la.hidden_size)
    mixed = la.in_proj_qkv(x)
    q, k, v = torch.split(mixed, [la.key_dim, la.key_dim, la.value_dim], dim=-1)
    q, k, v = _heads(q, la.head_k_dim), _heads(k, la.head_k_dim), _heads(v, la.head_v_dim)
    nk, nv = la.num_k_heads // tp, la.num_v_heads // tp
    segments = (la.key_dim, la.key_dim, la.value_dim)
    for rank in range(tp):
        idx = segment_index(segments, tp, rank)
        mine = mixed.index_select(-1, idx)
        widths = [la.key_dim // tp, la.key_dim // tp, la.value_dim // tp]
        lq, lk, lv = torch.split(mine, widths, dim=-1)
        assert torch.equal(_heads(lq, la.head_k_dim), q[..., rank * nk:(rank + 1) * nk, :])
        assert torch.equal(_heads(lk, la.head_k_dim), k[..., rank * nk:(rank + 1) * nk, :])
        assert torch.equal(_heads(lv, la.head_v_dim), v[..., rank * nv:(rank + 1) * nv, :])
        # value head j reads key head j // (nv / nk): the rank's value heads read its key heads
        ratio = la.num_v_heads // la.num_k_heads
        assert {j // ratio for j in range(rank * nv, (rank + 1) * nv)} == set(range(rank * nk, (rank + 1) * nk))
    contiguous = mixed[..., :mixed.shape[-1] // tp]  # what a plain column split gives rank 0
    assert not torch.equal(contiguous, mixed.index_select(-1, segment_index(segments, tp, 0)))


def test_segment_index_refuses_an_indivisible_segment():
    with pytest.raises(ValueError, match="not divisible by tensor_parallel=4"):
        segment_index((8, 6), 4, 0)


def test_layout_checks_name_the_linear_heads_and_packing():
    spec = FAMILIES["qwen3_5"]
    config = demo.tiny_model_config("qwen3_5")
    spec.validate_layout(config, sp=2, tp=4)
    config.text_config.linear_num_key_heads = 2
    with pytest.raises(ValueError, match="linear-attention key heads"):
        spec.validate_layout(config, sp=1, tp=4)
    spec.validate_layout(demo.tiny_model_config("qwen3_5"), sp=1, tp=1, packing=True)  # packs
    FAMILIES["qwen2_5_vl"].validate_layout(demo.tiny_model_config("qwen2_5_vl"), sp=1, tp=1, packing=True)


def test_plan_counts_the_replicated_linear_attention_parameters_whole():
    """`ray-dhp plan` classifies parameters by the TP plan: the conv weight, ``dt_bias``,
    ``A_log`` and every norm are replicated (held whole by each TP rank), all else is sharded."""
    from ray_dhp.models.sizes import count_params

    config = demo.tiny_model_config("qwen3_5")
    spec = FAMILIES["qwen3_5"]
    whole = spec.tp_partial_grad_suffixes + ("layernorm.weight", "language_model.norm.weight")
    text = {n: p.numel() for n, p in build_model(config).named_parameters()
            if not n.startswith("model.visual.")}
    counts = count_params(config)
    assert counts.text == sum(text.values())
    assert counts.text_sharded == sum(v for n, v in text.items() if not n.endswith(whole))
