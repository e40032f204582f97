"""Packed collation: several samples per row, each keeping its own positions, attention and
targets (`ray_dhp.data.collate.pack_text_batch`); the rows' attention one sample at a time
(`ray_dhp.models.segment_attention`)."""

from dataclasses import replace

import pytest
import torch

from ray_dhp.data import IGNORE_INDEX, pack_text_batch, pad_text_batch, read_annotations, resolve_data_root
from ray_dhp.data.collate import pack_rows
from ray_dhp.demo import make_dataset, tiny_model_config, tiny_processor
from ray_dhp.models import build_model
from tests.unit.packed_logits import assert_packed_logits_equal

MAX_TOKENS = 80  # samples here are 30-43 tokens (system turn included): rows of 2 samples


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Every 4th sample text-only, image sizes cycling through 3 shapes (grids 4x4, 4x6, 6x8)."""
    return make_dataset(tmp_path_factory.mktemp("shapes"), num_samples=6, text_only_every=4,
                        image_sizes=((56, 56), (84, 56), (112, 84)))


def _samples(family, dataset):
    proc = tiny_processor(family)
    return [proc.process(r, resolve_data_root(dataset)) for r in read_annotations(dataset)]


@pytest.fixture(scope="module")
def model64():
    """Tiny fp64 Qwen2.5-VL (random init); its get_rope_index is what the model computes."""
    return build_model(tiny_model_config("qwen2_5_vl"), seed=0, dtype=torch.float64).eval()


def test_pack_rows_in_order_as_few_and_as_even_as_greedy_allows():
    assert pack_rows([5, 3, 4, 2, 6], 8) == [range(0, 2), range(2, 4), range(4, 5)]
    # greedy to 8 makes rows of 8 + 4 (a row of 8 after padding: 16 tokens); 6 + 6 in 2 rows
    assert pack_rows([6, 1, 1, 1, 3], 8) == [range(0, 1), range(1, 5)]
    assert pack_rows([5, 3, 4], None) == [range(0, 3)]
    assert pack_rows([8, 8], 8) == [range(0, 1), range(1, 2)]
    with pytest.raises(ValueError, match="max_tokens=8"):
        pack_rows([3, 9], 8)


def test_pack_text_batch_boundaries_positions_targets(dataset, model64):
    samples = _samples("qwen2_5_vl", dataset)
    lengths = [s.num_tokens for s in samples]
    packed = pack_text_batch(samples, pad_id=0, max_tokens=MAX_TOKENS,
                             rope_index=model64.model.get_rope_index)
    rows = pack_rows(lengths, MAX_TOKENS)
    assert len(rows) > 1 and any(len(r) > 1 for r in rows)
    R, L = packed["input_ids"].shape
    assert (R, L) == (len(rows), max(sum(lengths[i] for i in r) for r in rows)) and L <= MAX_TOKENS
    assert packed["attention_mask"] is None and packed["position_ids"].shape == (4, R, L)

    # Positions as the model computes them in the padded batch (one sample per row).
    padded = pad_text_batch(samples, pad_id=0)
    rope, _ = model64.model.get_rope_index(padded["input_ids"], padded["mm_token_type_ids"],
                                           image_grid_thw=padded["image_grid_thw"],
                                           attention_mask=padded["attention_mask"])
    for row, rng in enumerate(rows):
        off = 0
        for i in rng:
            s, n = samples[i], lengths[i]
            cut = slice(off, off + n)
            assert torch.equal(packed["input_ids"][row, cut], s.input_ids)
            assert torch.equal(packed["labels"][row, cut], s.labels)
            assert torch.equal(packed["mm_token_type_ids"][row, cut], s.mm_token_type_ids)
            assert (packed["sample_ids"][row, cut] == i).all()
            # text positions restart at every sample; M-RoPE rows equal the model's own
            assert torch.equal(packed["position_ids"][0, row, cut], torch.arange(n))
            assert torch.equal(packed["position_ids"][1:, row, cut], rope[:, i, :n])
            # targets stay inside the sample: shifted labels, -100 at its last token
            assert torch.equal(packed["targets"][row, off:off + n - 1], s.labels[1:])
            assert packed["targets"][row, off + n - 1] == IGNORE_INDEX
            off += n
        tail = slice(off, L)
        assert not packed["input_ids"][row, tail].any() and (packed["sample_ids"][row, tail] == -1).all()
        assert (packed["targets"][row, tail] == IGNORE_INDEX).all()
        assert (packed["labels"][row, tail] == IGNORE_INDEX).all()
    assert int((packed["targets"] != IGNORE_INDEX).sum()) == sum(int((s.labels[1:] != IGNORE_INDEX).sum())
                                                                 for s in samples)
    # images in sample order
    assert torch.equal(packed["image_grid_thw"], padded["image_grid_thw"])
    assert torch.equal(packed["pixel_values"], padded["pixel_values"])


def test_packed_positions_give_a_block_diagonal_causal_mask(dataset, model64):
    """transformers builds the mask from the text-position row: no token sees another sample."""
    from transformers.masking_utils import create_causal_mask

    samples = _samples("qwen2_5_vl", dataset)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model64.model.get_rope_index)
    R, L = packed["input_ids"].shape
    config = model64.model.language_model.config
    assert config._attn_implementation == "sdpa"
    mask = create_causal_mask(config=config, inputs_embeds=torch.zeros(R, L, 8, dtype=torch.float64),
                              attention_mask=None, cache=None, position_ids=packed["position_ids"][0])
    ids = packed["sample_ids"]  # the padded tail (-1) is a block of its own
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    expected = (ids[:, :, None] == ids[:, None, :]) & causal
    assert torch.equal(mask[:, 0], expected)


@pytest.mark.parametrize("family", ["qwen2_5_vl", pytest.param("qwen3_vl", marks=pytest.mark.slow),
                                    pytest.param("qwen2_vl", marks=pytest.mark.slow)])
def test_packed_forward_equals_padded_fp64(family, dataset, model64):
    """Per-token logits of each sample are the same packed or padded (fp64: only the summation
    order of the attention over a longer masked row differs, ~1e-16 measured; 1e-12 bound)."""
    samples = _samples(family, dataset)
    model = model64 if family == "qwen2_5_vl" else build_model(
        tiny_model_config(family), seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model.model.get_rope_index)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  use_cache=False)
    assert_packed_logits_equal(model, samples, padded, packed, common)


def test_grids_without_pixels(dataset, model64):
    """Text-only ranks may get samples with grids but no pixels: the grids still come through."""
    samples = _samples("qwen2_5_vl", dataset)
    no_pixels = [replace(s, pixel_values=None) for s in samples]
    for batch in (pad_text_batch(no_pixels, 0),
                  pack_text_batch(no_pixels, 0, rope_index=model64.model.get_rope_index)):
        assert batch["pixel_values"] is None
        assert torch.equal(batch["image_grid_thw"],
                           torch.cat([s.image_grid_thw for s in samples if s.image_grid_thw is not None]))
    mixed = pad_text_batch([samples[0], replace(samples[1], pixel_values=None)], 0)
    assert mixed["pixel_values"] is None and mixed["image_grid_thw"].shape[0] == 2
    with pytest.raises(ValueError, match="rope_index"):
        pack_text_batch(samples, 0)



def test_cu_seqlens_are_the_samples_and_the_padded_tails(dataset, model64):
    samples = _samples("qwen2_5_vl", dataset)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model64.model.get_rope_index,
                             pad_to_multiple_of=7)
    ids = packed["sample_ids"].reshape(-1)
    R, L = packed["input_ids"].shape
    cu = packed["cu_seqlens"]
    assert cu[0] == 0 and cu[-1] == R * L
    starts = cu[:-1]
    # a segment starts at every row start and wherever the sample id changes along a row
    flat_pos = torch.arange(R * L)
    change = (flat_pos % L == 0) | torch.cat([torch.tensor([True]), ids[1:] != ids[:-1]])
    assert torch.equal(starts, flat_pos[change])
    assert torch.equal(packed["position_ids"][0].reshape(-1)[starts], torch.zeros_like(starts))


def test_segment_layout_aligns_segments_and_round_trips():
    """Rows of 10 tokens, segments 3+1+6 and 2+8: each row's first segment at 0, every later one
    at the next multiple of 4 at least 2 zeros after the previous end."""
    from ray_dhp.parallel.segments import segment_layout

    cu = torch.tensor([0, 3, 4, 10, 12, 20])
    layout = segment_layout(cu, 10, align=4, gap=2)
    gap = 20
    assert layout.to_rows.tolist() == [
        [0, 1, 2, gap, gap, gap, gap, gap, 3, gap, gap, gap, 4, 5, 6, 7, 8, 9],
        [10, 11, gap, gap, 12, 13, 14, 15, 16, 17, 18, 19, gap, gap, gap, gap, gap, gap]]
    assert layout.starts.nonzero().tolist() == [[0, 0], [0, 8], [0, 12], [1, 0], [1, 4]]
    assert torch.equal(layout.to_rows.reshape(-1)[layout.to_packed], torch.arange(20))
    x = torch.randn(2, 10, 3)
    assert torch.equal(layout.packed(layout.rows(x), 2), x)
    plain = segment_layout(cu, 10)  # align 1, no gap: the packed rows themselves
    assert torch.equal(plain.to_rows, torch.arange(20).view(2, 10))
    with pytest.raises(ValueError, match="rise strictly"):
        segment_layout(torch.tensor([0, 3, 3]), 3)
    with pytest.raises(ValueError, match="crosses a row end"):
        segment_layout(torch.tensor([0, 3, 12, 20]), 10)


@pytest.mark.parametrize("family", ["qwen3_5", pytest.param("qwen3_5_moe", marks=pytest.mark.slow)])
def test_recurrent_packed_forward_equals_padded_fp64(family, dataset):
    """Qwen3.5's Gated DeltaNet layers in packed rows: with `install_segment_rows` (the family's
    `stateful_mixers`: chunk-aligned rows, the state reset where a sample starts) and the batch's
    ``cu_seqlens`` each sample's logits equal its padded row's within 1e-12 (fp64; the delta rule
    runs in fp32; its forward gives the same bits on the same per-sample values: measured
    ~1e-16). Negative controls: without the segments, and with the samples only the conv's 3
    zeros apart (chunk 1) and the reset disabled (the conv window starts from zeros, the
    recurrent state runs on into the next sample), the logits differ by far more."""
    from ray_dhp.models import FAMILIES
    from ray_dhp.models.segments import SEGMENTS_KWARG, install_segment_rows

    samples = _samples(family, dataset)
    model = build_model(tiny_model_config(family), seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model.model.get_rope_index)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  use_cache=False)
    with pytest.raises(AssertionError):  # the negative control: no reset at sample boundaries
        assert_packed_logits_equal(model, samples, padded, packed, common)
    (spec,) = FAMILIES[family].stateful_mixers
    layers = sum(t == "linear_attention" for t in model.config.text_config.layer_types)
    segments = {SEGMENTS_KWARG: packed["cu_seqlens"]}
    leaky = build_model(tiny_model_config(family), seed=0, dtype=torch.float64).eval()
    no_reset = replace(spec, chunk=1, resetting=lambda *a, starts, **k: spec.resetting(*a, starts=None, **k))
    assert install_segment_rows(leaky.model.language_model, (no_reset,)) == layers
    with pytest.raises(AssertionError):  # samples 3 zeros apart, no state reset
        assert_packed_logits_equal(leaky, samples, padded, packed, common, segments)
    assert install_segment_rows(model.model.language_model, (spec,)) == layers
    assert_packed_logits_equal(model, samples, padded, packed, common, segments)


def test_one_dimensional_packed_forward_equals_padded_fp64(dataset):
    """InternVL's LM (1-D RoPE, `FamilySpec.packed_positions` "1d"): packed ``position_ids`` are
    the text positions ``[R, L]``, restarting at each sample, with no ``get_rope_index``; each
    sample's logits equal its padded row's within 1e-12 (measured ~5e-16)."""
    from ray_dhp.models import FAMILIES

    family, config = FAMILIES["internvl"], tiny_model_config("internvl")
    samples = _samples("internvl", dataset)
    model = build_model(config, seed=0, dtype=torch.float64).eval()
    assert family.rope_index(model) is None
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, one_dimensional=True)
    assert packed["position_ids"].shape == packed["input_ids"].shape
    assert len(pack_rows([s.num_tokens for s in samples], MAX_TOKENS)) < len(samples)
    common = family.stock_inputs(config, dict(pixel_values=padded["pixel_values"].double(),
                                              image_grid_thw=padded["image_grid_thw"], use_cache=False))
    assert_packed_logits_equal(model, samples, padded, packed, common)


def _cumsum_with_resets(x, starts, chunk_size=1):
    """A running sum restarting at every start (``chunk_size`` 1: any token may start)."""
    ids = starts.long().cumsum(1)
    out = torch.zeros_like(x)
    for r in range(x.shape[0]):
        for i in ids[r].unique():
            at = ids[r] == i
            out[r, at] = x[r, at].cumsum(0)
    return out


def test_required_segments_refuse_a_forward_without_them():
    """Installed by a packing engine (``required=True``), a mixer called without the segments
    raises: a transformers forward that stopped handing its keyword arguments down would
    otherwise let packed samples share the recurrent state silently; so does a forward that no
    longer calls the recurrence by the family's name."""
    from ray_dhp.models.segments import SEGMENTS_KWARG, StatefulMixer, install_segment_rows

    class Mixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.out_proj = torch.nn.Linear(2, 2)
            self.scan = lambda x: x.cumsum(1)  # state along the sequence

        def forward(self, hidden_states):
            return self.out_proj(self.scan(hidden_states))

    model = torch.nn.Sequential(Mixer())
    spec = StatefulMixer("0", "out_proj", recurrence=("scan",), resetting=_cumsum_with_resets, chunk=1)
    assert install_segment_rows(model, (spec,), required=True) == 1
    x = torch.randn(1, 5, 2)
    got = model[0](hidden_states=x, **{SEGMENTS_KWARG: torch.tensor([0, 2, 5])})
    want = torch.cat([model[0].out_proj(x[:, :2].cumsum(1)), model[0].out_proj(x[:, 2:].cumsum(1))], 1)
    assert torch.allclose(got, want)
    assert torch.allclose(model[0].scan(x), x.cumsum(1))  # outside a packed call: the stock one
    with pytest.raises(RuntimeError, match="packed samples would share its state"):
        model[0](hidden_states=x)
    model[0].forward = lambda hidden_states: model[0].out_proj(hidden_states.cumsum(1))
    with pytest.raises(RuntimeError, match="did not call 'scan'"):
        model[0](hidden_states=x, **{SEGMENTS_KWARG: torch.tensor([0, 2, 5])})


def test_segment_attention_equals_padded_fp64_one_call_per_segment(dataset, monkeypatch):
    """Tiny fp64 Qwen2.5-VL, 6 samples (images of 3 sizes, a text-only one) packed into rows of
    80 tokens: each sample's logits equal its padded row's within 1e-12 of the row's largest
    logit (only SDPA's summation blocking differs; measured ~5e-16), with one SDPA call per
    segment and layer (samples and padded tails) and no mask built; a forward that does not
    hand the segments down raises."""
    import transformers.integrations.sdpa_attention as sdpa

    from ray_dhp.models.segment_attention import ATTN_NAME, install_segment_attention
    from ray_dhp.models.segments import SEGMENTS_KWARG

    samples = _samples("qwen2_5_vl", dataset)
    model = build_model(tiny_model_config("qwen2_5_vl"), seed=0, dtype=torch.float64).eval()
    padded = pad_text_batch(samples, 0)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=model.model.get_rope_index)
    common = dict(pixel_values=padded["pixel_values"].double(), image_grid_thw=padded["image_grid_thw"],
                  use_cache=False)
    with torch.no_grad():
        ref = model(input_ids=padded["input_ids"], attention_mask=padded["attention_mask"],
                    mm_token_type_ids=padded["mm_token_type_ids"], **common).logits
        lm = model.model.language_model
        assert install_segment_attention(lm) == "" and lm.config._attn_implementation == ATTN_NAME
        assert model.model.visual.config._attn_implementation == "sdpa"  # the tower's own, untouched
        masks, calls = [], []
        real = sdpa.sdpa_attention_forward

        def spy(module, q, k, v, mask, *a, **kw):
            masks.append(mask)
            calls.append(q.shape[2])
            return real(module, q, k, v, mask, *a, **kw)

        monkeypatch.setattr(sdpa, "sdpa_attention_forward", spy)
        packed_kw = dict(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                         mm_token_type_ids=packed["mm_token_type_ids"], **common)
        got = model(**packed_kw, **{SEGMENTS_KWARG: packed["cu_seqlens"]}).logits
        with pytest.raises(RuntimeError, match="would attend across"):
            model(**packed_kw)
    ids = packed["sample_ids"]
    for i, s in enumerate(samples):
        assert (got[ids == i] - ref[i, :s.num_tokens]).abs().max() <= 1e-12 * ref[i].abs().max()
    segments = (packed["cu_seqlens"][1:] - packed["cu_seqlens"][:-1]).tolist()
    assert calls == segments * lm.config.num_hidden_layers and all(m is None for m in masks)


def test_refused_where_not_plain_causal_inside_a_sample():
    """Windows and bidirectional image blocks keep transformers' block mask (`refusal`), as does
    an attention other than sdpa."""
    from types import SimpleNamespace as NS

    from ray_dhp.models.segment_attention import install_segment_attention, refusal

    assert refusal(NS(layer_types=["full_attention", "linear_attention"])) == ""
    assert "window" in refusal(NS(layer_types=["sliding_attention", "full_attention"]))
    assert "window" in refusal(NS(sliding_window=4096, use_sliding_window=True))
    assert refusal(NS(sliding_window=4096, use_sliding_window=False)) == ""
    assert "chunked" in refusal(NS(attention_chunk_size=8192))
    assert "'indexed_attention'" in refusal(NS(layer_types=["indexed_attention"]))  # Mistral Large 4
    assert "bidirectional" in refusal(NS(), causal_in_sample=False)
    lm = torch.nn.Module()
    lm.config = NS(_attn_implementation="eager")
    assert "'eager'" in install_segment_attention(lm) and lm.config._attn_implementation == "eager"


def _generic_logits(family_name, dataset, config=None, spec=None, segments=False, edit=None):
    """``(samples, padded, packed, padded logits, packed logits)`` of a generic family's tiny
    fp64 model (``config``: another config of it; ``spec``: another `FamilySpec` for it), each
    forward's keywords as the family hands them to the stock forward; ``segments``: its
    `stateful_mixers` run one row per sample (`install_segment_rows`), the packed forward given
    the batch's ``cu_seqlens`` as the engine gives them; ``edit``: changes the packed batch
    before its forward (a negative control)."""
    from ray_dhp.models import family_of
    from ray_dhp.models.segments import SEGMENTS_KWARG, install_segment_rows

    config = config or tiny_model_config(family_name)
    spec, samples = spec or family_of(config), _samples(family_name, dataset)
    model = build_model(config, seed=0, dtype=torch.float64).eval()
    if segments:
        assert install_segment_rows(spec.language_model(model), spec.stateful_mixers) > 0
    pad_id = config.get_text_config().pad_token_id or 0
    padded = pad_text_batch(samples, pad_id)
    packed = pack_text_batch(samples, pad_id, MAX_TOKENS, rope_index=spec.rope_index(model),
                             one_dimensional=spec.packed_positions == "1d")
    assert len(pack_rows([s.num_tokens for s in samples], MAX_TOKENS)) < len(samples)
    if edit is not None:
        edit(packed)
    logits = []
    for batch in (padded, packed):
        kw = {k: batch.get(k) for k in ("input_ids", "attention_mask", "position_ids",
                                        "mm_token_type_ids", "pixel_values", "image_grid_thw")}
        kw = spec.stock_inputs(config, {**{k: v for k, v in kw.items() if v is not None},
                                        "use_cache": False})
        kw["pixel_values"] = kw["pixel_values"].double()
        if segments and batch is packed:
            kw[SEGMENTS_KWARG] = packed["cu_seqlens"]
        with torch.no_grad():
            logits.append(model(**kw).logits)
    return samples, packed, logits[0], logits[1]


def _max_sample_error(samples, packed, ref, got) -> float:
    ids = packed["sample_ids"]
    return max(float((got[ids == i] - ref[i, :s.num_tokens]).abs().max() / ref[i].abs().max())
               for i, s in enumerate(samples))


_GENERIC_PACKED = ["llava"] + [pytest.param(f, marks=pytest.mark.slow) for f in (
    "paligemma", "aya_vision", "cohere2_vision", "mistral3", "idefics3", "smolvlm", "glm4v",
    "glm46v", "glmga", "glm_ocr", "lighton_ocr", "hyperclovax_vision_v2", "got_ocr2",
    "pp_chart2table", "video_llava", "kimi_k25", "cosmos3_edge", "paddleocr_vl",
    "llava_onevision1_5", "ernie4_5_vl_moe", "llama4", "gemma4", "mistral_large4",
    "minimax_m3_vl", "exaone4_5")]


@pytest.mark.parametrize("family", _GENERIC_PACKED)
def test_generic_packed_forward_equals_padded_fp64(family, dataset):
    """Every generic family that packs (`ray_dhp.models.generic_packing`): each sample's logits
    from the packed rows (its positions from the family's rule, no 2-D mask, ``use_cache=False``
    as the family's inputs carry it) equal its padded row's within 1e-12 of the row's largest
    logit (fp64; measured 0 to 8e-16). Not here: the LLaVA-NeXT kinds (an anyres sample of 101
    tokens is over ``MAX_TOKENS``), Gemma 3 / ShieldGemma 2 and the stateful mixers (below).
    PaliGemma's Gemma RMSNorm computes in fp32
    (``x.float()``): a 1e-16 difference of the attention sums that crosses an fp32 rounding moves
    a value by up to 2^-24 ~ 6e-8 (measured 6.5e-8); it is held to 1e-6, far below a sample
    attending across a boundary (0.79, the Gemma 3 test below)."""
    from ray_dhp.models import family_of

    assert family_of(tiny_model_config(family)).packing
    tol = 1e-6 if family == "paligemma" else 1e-12
    assert _max_sample_error(*_generic_logits(family, dataset)) <= tol


@pytest.mark.parametrize("family", ["gemma3", pytest.param("shieldgemma2", marks=pytest.mark.slow)])
def test_gemma3_packed_masks_per_sample_fp64(family, dataset):
    """Gemma 3's sliding-window layers read their image blocks through a mask rule transformers
    evaluates at packed positions: packed, the masks are built per sample by the model's own
    ``create_masks_for_generate`` (`ray_dhp.models.packed_masks`) and each sample's logits equal
    its padded row's within 1e-12 (fp64; measured 0). The negative control: the same packed rows
    with transformers' own packed-mask detection (``packed_masks`` off) differ (a text sample
    packed after an image sample attends where it would not alone; measured 0.79 of the row's
    largest logit)."""
    from ray_dhp.models import family_of

    spec = family_of(tiny_model_config(family))
    assert spec.packing and spec.packed_masks and not spec.segment_attention
    assert _max_sample_error(*_generic_logits(family, dataset)) <= 1e-12
    old = replace(spec, packed_masks=False)
    assert _max_sample_error(*_generic_logits(family, dataset, spec=old)) > 1e-3


def test_layers_that_carry_state_are_every_kind_but_softmax_attention():
    """`generic_packing` runs one row per sample the layers of every type but softmax attention:
    a short convolution and a linear attention (a recurrence) carry state along the sequence
    (the slow test below measures what each leaks packed without)."""
    from ray_dhp.models.generic_packing import _carries_state

    assert [t for t in ("full_attention", "sliding_attention", "chunked_attention",
                        "indexed_attention", "linear_attention", "conv", "mamba")
            if _carries_state(t)] == ["linear_attention", "conv", "mamba"]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["lfm3_vl", "lfm2_vl", "minicpmv4_6", "qwen4_exp"])
def test_short_conv_packed_one_row_per_sample_fp64(family, dataset):
    """LFM-VL's short causal convolution (``conv`` layer types) carries its window along the
    sequence, as a linear attention (``linear_attention``: the Gated DeltaNet of MiniCPM-V 4.6's
    Qwen3.5 LM and of Qwen4-Exp) carries its conv window and recurrent state: the generic family
    reads these mixers from the module tree (the layer's child with a ``layer_idx``, its one
    projection back to the hidden width: ``layers.i.conv`` / ``layers.i.linear_attn``,
    ``out_proj``) and runs them one row per sample (`ray_dhp.models.segments`): each sample's
    logits equal its padded row's within 1e-12 (fp64; measured 0 to 4.4e-16). The negative
    control: without the reset the state runs into the next sample (measured 0.55 of the row's
    largest logit for LFM3-VL, 0.12 MiniCPM-V 4.6, 0.023 Qwen4-Exp: what these two packed before
    their linear attention counted as stateful)."""
    from ray_dhp.models import family_of
    from tests.distributed.generic_cases import lfm2_vl_hybrid_config

    config = lfm2_vl_hybrid_config() if family == "lfm2_vl" else tiny_model_config(family)
    spec = family_of(config)
    types = config.get_text_config().layer_types
    mixer = {"conv": "conv", "linear_attention": "linear_attn"}
    assert spec.packing and spec.stateful_mixers == tuple(
        (f"layers.{i}.{mixer[t]}", "out_proj") for i, t in enumerate(types) if t in mixer)
    assert _max_sample_error(*_generic_logits(family, dataset, config, segments=True)) <= 1e-12
    assert _max_sample_error(*_generic_logits(family, dataset, config)) > 1e-3


def _positions_not_restarted(packed):
    """A packed batch's positions counted on along each row (every axis), not restarted at
    each sample (a negative control)."""
    pos = packed["position_ids"]
    packed["position_ids"] = torch.arange(pos.shape[-1]).expand(pos.shape).clone()


def test_minicpm_v4_7_packed_positions_are_its_own_rope_index(dataset):
    """MiniCPM-V 4.7's ``get_rope_index`` (a canvas M-RoPE over each image's thumbnail and
    slices) takes the images' grids as ``target_sizes``, the name its stock forward hands them
    on under: the generic family calls it on each packed sample alone with the arguments its
    signature names (`ray_dhp.models.generic_packing.packed_rope_index`), and each sample's
    positions equal what the model computes for the padded batch (exact: integers), its text
    positions restarting at 0. Its language model's Gated DeltaNet layers (``linear_attention``,
    a type transformers builds a recurrent mask for) carry state: they run one row per sample."""
    from ray_dhp.models import family_of
    from ray_dhp.models.generic_packing import rope_index_refusal
    from ray_dhp.models.generic_probe import packed_grid

    config = tiny_model_config("minicpmv4_7")
    spec = family_of(config)
    with torch.device("meta"):
        model = build_model(config)
    inner = spec.vision_owner(model)
    assert spec.packing and spec.packed_positions == "mrope"
    assert "target_sizes" in rope_index_refusal(type(inner).get_rope_index)  # not Qwen-VL's names
    assert spec.stateful_mixers == (("layers.0.linear_attn", "out_proj"),
                                    ("layers.1.linear_attn", "out_proj"))
    samples = _samples("minicpmv4_7", dataset)
    packed = pack_text_batch(samples, 0, MAX_TOKENS, rope_index=spec.rope_index(model))
    padded = pad_text_batch(samples, 0)
    ref, _ = inner.get_rope_index(padded["input_ids"], padded["mm_token_type_ids"],
                                  attention_mask=padded["attention_mask"],
                                  **packed_grid(padded["image_grid_thw"]))
    ids, canvas = packed["sample_ids"], 0
    for i, s in enumerate(samples):
        got = packed["position_ids"][:, ids == i]
        assert torch.equal(got[0], torch.arange(s.num_tokens))
        assert torch.equal(got[1:], ref[:, i, :s.num_tokens])
        canvas += not torch.equal(got[1:], got[:1].expand(3, -1))
    assert canvas >= 3  # the image samples' positions are 2-D canvases, not 1-D


@pytest.mark.slow
@pytest.mark.parametrize("family", ["minicpmv4_7", "minicpm_ocr", "minicpmv4_6"])
def test_qwen3_5_lm_generic_packed_forward_equals_padded_fp64(family, dataset):
    """MiniCPM-V 4.7 (canvas M-RoPE from its own ``get_rope_index``), MiniCPM-OCR and MiniCPM-V
    4.6 (1-D positions): a Qwen3.5 language model, here with a Gated DeltaNet layer then a gated
    full-attention layer (`qwen3_5_lm_hybrid_config`; the tiny default has linear attention only,
    which reads no positions). Packed, each sample's logits equal its padded row's within 1e-12
    of the row's largest logit (fp64; measured 3.5e-16 / 4.9e-16 for the first two). Negative
    controls, each far out of that: the Gated DeltaNet state carried into the next sample (no
    per-sample rows; measured 5.8e-2 / 6.0e-2 / 5.8e-2), positions counted on along the row
    instead of restarting per sample (a sample's attention then reaches the samples before it;
    measured 0.44 each) and, for MiniCPM-V 4.7, 1-D positions in place of its canvas rule
    (measured 9.2e-2)."""
    from ray_dhp.models import family_of
    from tests.distributed.generic_cases import qwen3_5_lm_hybrid_config

    config = qwen3_5_lm_hybrid_config(family)
    spec = family_of(config)
    assert spec.packing and spec.stateful_mixers == (("layers.0.linear_attn", "out_proj"),)
    assert spec.packed_positions == ("mrope" if family == "minicpmv4_7" else "1d")
    assert _max_sample_error(*_generic_logits(family, dataset, config, segments=True)) <= 1e-12
    errs = [_max_sample_error(*_generic_logits(family, dataset, config)),
            _max_sample_error(*_generic_logits(family, dataset, config, segments=True,
                                               edit=_positions_not_restarted))]
    if family == "minicpmv4_7":
        errs.append(_max_sample_error(*_generic_logits(
            family, dataset, config, spec=replace(spec, packed_positions="1d"), segments=True)))
    assert min(errs) > 1e-3, errs


@pytest.mark.slow
def test_qwen4_exp_linear_attention_packed_one_row_per_sample_fp64(dataset):
    """Qwen4-Exp's language model (a mixture of experts) has Gated DeltaNet layers
    (``linear_attention``, a type transformers builds a recurrent mask for): the generic family
    runs them one row per sample, and each sample's logits equal its padded row's within 1e-12
    (fp64, its tiny default config: linear attention only; measured 2.7e-16). Without the
    per-sample rows the state runs into the next sample (measured 2.3e-2)."""
    from ray_dhp.models import family_of

    spec = family_of(tiny_model_config("qwen4_exp"))
    assert spec.packing and spec.stateful_mixers == (("layers.0.linear_attn", "out_proj"),
                                                     ("layers.1.linear_attn", "out_proj"))
    assert _max_sample_error(*_generic_logits("qwen4_exp", dataset, segments=True)) <= 1e-12
    assert _max_sample_error(*_generic_logits("qwen4_exp", dataset)) > 1e-3
