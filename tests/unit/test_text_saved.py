"""A generic family's decoder layers measured on the meta device (`ray_dhp.models.text_saved`) save
what the same language model saves on CPU, split as its text TP plan shards them, and the planner
takes them for the block formula (`ray_dhp.planning.memory.text_activation_parts`)."""

import pytest
import torch


def _cpu_saved(config, family, tokens: int = 64) -> list:
    """Per decoder layer, the bytes per token the CPU forward of a ``tokens``-token row saves for
    backward (storages once, parameters and what the layer is handed — rotary tables, masks —
    excluded)."""
    import transformers

    from ray_dhp.models.text_saved import _is_param, _storages

    model = getattr(transformers, family.model_class)._from_config(config, dtype=torch.float32)
    decoder = family.language_model(model)
    per, current, seen, handed = [0] * len(decoder.layers), [None], set(), set()

    def enter(i):
        def hook(_m, _args, kwargs):
            current[0] = i
            _storages({k: v for k, v in kwargs.items() if k != "hidden_states"}, handed)
        return hook

    for i, layer in enumerate(decoder.layers):
        layer.register_forward_pre_hook(enter(i), with_kwargs=True)
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))
    keep = []

    def pack(t):
        st = t.untyped_storage()
        if current[0] is not None and not _is_param(t) and st._cdata not in seen | handed:
            seen.add(st._cdata)
            keep.append(st)
            per[current[0]] += st.nbytes()
        return t

    embeds = torch.ones(1, tokens, config.get_text_config().hidden_size, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        decoder(inputs_embeds=embeds, use_cache=False)
    return [b / tokens for b in per]


def test_meta_probe_matches_cpu_splits_by_the_tp_plan_and_feeds_the_plan():
    from ray_dhp import demo
    from ray_dhp.models import family_of, text_saved_per_token
    from ray_dhp.planning.memory import ActivationSettings, text_activation_parts

    config = demo.tiny_model_config("aya_vision")  # Cohere's parallel block: one norm per layer
    probed = text_saved_per_token(config, 4)
    assert [r + s for r, s in probed.layers] == pytest.approx(_cpu_saved(config, family_of(config)))
    tc = config.get_text_config()
    h, i, heads = tc.hidden_size, tc.intermediate_size, tc.num_attention_heads
    # sharded: q, k, v, the attention output, its fp32 log-sum-exp, the gated MLP's four
    # i-wide tensors (fp32); the rest (the norm's, the residual) replicated
    assert all(s == 4 * (4 * h + heads + 4 * i) for _, s in probed.layers)
    s = ActivationSettings(4, "flash", False)
    # the rotary cos and sin (fp32, head_dim wide); the final norm (Cohere's LayerNorm)
    assert probed.tables == 2 * 4 * (getattr(tc, "head_dim", None) or h // heads)
    assert text_saved_per_token(config, 4, 40).tables == probed.tables  # at any row length
    assert probed.outside > 0
    base = text_activation_parts(tc, 100, 2, s, probed=probed._replace(
        layers=((0.0, 0.0),) * len(probed.layers)))[0]
    assert text_activation_parts(tc, 100, 2, s, probed=probed)[0] == pytest.approx(
        base + 100 * sum(r + s / 2 for r, s in probed.layers))
    # a layer the TP plan leaves whole (LFM2's short convolutions): nothing sharded
    assert all(s == 0 for _, s in text_saved_per_token(demo.tiny_model_config("lfm2_vl"), 4).layers)
    # a hand-written family keeps its formula
    assert text_saved_per_token(demo.tiny_model_config("qwen2_5_vl"), 4) is None



def test_probe_follows_the_row_length_and_measures_experts_not_handed_the_routing():
    """A chunked linear-attention kernel pads a row to its 64-token chunks (MiniCPM-V 4.6's
    Qwen3.5 decoder, the torch fallback): what a token saves depends on the row's length, and
    the probe runs at the planner's row length. Llama 4's experts module is handed the hidden
    rows alone (every expert on every token): the probe runs it and measures its rows, where a
    module handed the routing is a stub whose rows the planner counts by formula."""
    from ray_dhp import demo
    from ray_dhp.models import family_of, text_saved_per_token

    config = demo.tiny_model_config("minicpmv4_6")
    short, long = (text_saved_per_token(config, 4, n) for n in (40, 64))
    assert [r + s for r, s in short.layers] == pytest.approx(
        _cpu_saved(config, family_of(config), 40))
    assert short.layers[0][0] > 1.2 * long.layers[0][0]  # 40 tokens padded to a 64-token chunk
    llama4 = demo.tiny_model_config("llama4")
    probed = text_saved_per_token(llama4, 4)
    assert probed.stubbed == frozenset()
    assert [r + s for r, s in probed.layers] == pytest.approx(_cpu_saved(llama4, family_of(llama4)))
    assert text_saved_per_token(demo.tiny_model_config("glm4v_moe"), 4).stubbed  # its sparse layer


def test_split_input_slices_its_own_storage_and_leaves_the_callers_tensor_replicated():
    """A ``rowwise_split_input`` linear saves its input's local slice (DTensor's redistribution:
    a storage of its own); the caller's tensor stays whole on the rank. Qwen4-Exp's hyper-
    connections split their normed ``hc_count x h`` input into ``input_mix_weight_down`` and mix
    the whole one into the Gated DeltaNet's input: marking the caller's tensor sharded had halved
    the whole mixer under TP2 (its plan-accuracy row read 0.565, now 1.001)."""
    from ray_dhp import demo
    from ray_dhp.models import text_saved_per_token

    config = demo.tiny_model_config("qwen4_exp")
    tc = config.get_text_config()
    probed = text_saved_per_token(config, 4)
    assert set(tc.layer_types) == {"linear_attention"}
    # sharded: the two hyper-connections' slices (fp32, hc_count x h) and the shared expert's
    # gate, up, activation and product (its colwise / rowwise pair); the mixer replicated
    split = 2 * 4 * tc.hc_count * tc.hidden_size
    assert all(s == split + 4 * 4 * tc.shared_expert_intermediate_size for _, s in probed.layers)
    assert all(r > 20 * s for r, s in probed.layers)
    # GLM-4V's fused gate_up -> down_proj: the slice is the only saved copy of down_proj's input
    glm = text_saved_per_token(demo.tiny_model_config("glm4v"), 4)
    gtc = demo.tiny_model_config("glm4v").get_text_config()
    assert all(s >= 4 * gtc.intermediate_size for _, s in glm.layers)
