"""The planner's per-layer models of what an LM layer saves for backward beyond attention and a
dense MLP (`ray_dhp.planning.memory_layers`), against the bytes ``saved_tensors_hooks`` sees in
transformers' own layers of the demo's tiny models (CPU, fp32, each storage once, parameters
excluded): a Gated DeltaNet layer (Qwen3.5, `FamilySpec.text_mixer_saved`) within 2% for rows
not a multiple of the 64-token chunk, and a sparse MoE block (Qwen3-VL-MoE's router and stock
experts) exactly. The engine-level figures are the plan-accuracy matrix's
(``benchmarks/plan_accuracy.py``)."""

import pytest
import torch

pytestmark = pytest.mark.slow


def _saved(model, prefixes, run) -> int:
    """Bytes saved while a module whose name starts with one of ``prefixes`` runs."""
    from benchmarks.measure import _is_param

    stack, seen, total = [], set(), [0]
    for name, m in model.named_modules():
        m.register_forward_pre_hook(lambda *_, n=name: stack.append(n))
        m.register_forward_hook(lambda *_: (stack.pop(), None)[1])

    def pack(t):
        if not _is_param(t) and stack and stack[-1].startswith(prefixes):
            st = t.untyped_storage()
            if (st.data_ptr(), st.nbytes()) not in seen:
                seen.add((st.data_ptr(), st.nbytes()))
                total[0] += st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run()
    return total[0]


def _lm(family):
    import transformers

    from ray_dhp import demo
    from ray_dhp.models import family_of

    config = demo.tiny_model_config(family)
    torch.manual_seed(0)
    model = getattr(transformers, family_of(config).model_class)(config)
    return config, model.model.language_model


@pytest.mark.parametrize("rows,tokens", [(1, 40), (2, 100), (1, 150)])
def test_gated_deltanet_layer(rows, tokens):
    from ray_dhp.models.qwen3_5 import linear_attention_saved

    config, lm = _lm("qwen3_5")
    ids = torch.randint(3, config.text_config.vocab_size, (rows, tokens))
    # the layer's own tensors, its gated norm and out_proj (its input projections keep the
    # pre-norm's output, counted with the norm)
    got = _saved(lm, ("layers.0.linear_attn",), lambda: lm(input_ids=ids))
    got -= rows * tokens * config.text_config.hidden_size * 4
    want = linear_attention_saved(config.text_config, rows, tokens, 1, 4)
    assert abs(want / got - 1) < 0.02, (want, got)  # 1 row of 1 chunk: +1.8% (no operand copies)


def test_sparse_block_router_and_stock_experts():
    from ray_dhp.planning.memory_layers import routed_bytes, text_layers

    config, lm = _lm("qwen3_vl_moe")
    tc, tokens = config.text_config, 40
    ids = torch.randint(3, tc.vocab_size, (1, tokens))
    got = _saved(lm, ("layers.0.mlp",), lambda: lm(input_ids=ids))
    got -= tokens * tc.hidden_size * 4  # the router's input: the pre-norm's output
    layers = text_layers(config)
    assert layers.sparse == tc.num_hidden_layers and layers.ep == 1
    assert routed_bytes(layers, tc.hidden_size, tokens, 4) == got
