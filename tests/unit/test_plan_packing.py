"""`ray-dhp plan` and ``--recommend`` with ``data.packing`` (issue #43): a text replica's
activations are those of its packed rows (`ray_dhp.planning.packing`), not of its padded samples.

The 32B example at one micro-batch of 5 samples (vision SP8, text TP8: 5 samples per replica of
each), 4096 patch tokens and 512 text tokens per sample (1,536 LLM tokens), ``data.max_tokens``
4096: 2 samples per row, 3 rows of 3,072 tokens (the last one padded), 9,216 tokens instead of
5 x 1,536 = 7,680. With eager attention each packed row keeps its 3,072² scores (the engine
masks a whole row), so that term grows 2.4x (9,216 x 3,072 vs 7,680 x 1,536)."""

import os
import re

import pytest

from ray_dhp.cli.plan import plan_text, settings_of
from ray_dhp.data.collate import pack_rows
from ray_dhp.parallel.packed_rows import pack_order
from ray_dhp.planning.memory import GIB, text_activation_bytes
from ray_dhp.planning.packing import Packing
from ray_dhp.run_file import load_run_file

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "qwen2_5_vl_32b_8gpu.yaml")
FIVE = ["optim.global_batch_size=5", "optim.micro_batches=1"]
PACKED = FIVE + ["data.packing=true", "data.max_tokens=4096"]


def _text_acts(text: str) -> set:
    return {float(m) for m in re.findall(r"text act +([\d.]+) GiB", text)}


def test_packed_rows_of_uniform_samples():
    assert Packing(4096).rows(5, 1536) == (3, 3072)
    assert Packing(4096).text_tokens(5, 1536) == (9216, 3072)
    assert Packing(None).rows(5, 1536) == (1, 7680)  # no limit: one row
    assert Packing(1536).rows(5, 1536) == (5, 1536)  # one sample per row: as padded
    assert Packing(8192).rows(1, 1536) == (1, 1536)


@pytest.mark.parametrize("max_tokens", [None, 1000, 2048, 4096])
def test_plan_rows_are_the_engines_rows_of_uniform_samples(max_tokens):
    """The plan's rows are those the engine lays out (`pack_order`, then `pack_rows`) for
    samples of one length."""
    for n in range(1, 13):
        for s in (100, 333, 512, 1000):
            lengths = [s] * n
            laid = [lengths[i] for i in pack_order(lengths, max_tokens)]
            rows = pack_rows(laid, max_tokens)
            want = (len(rows), max(sum(laid[i] for i in r) for r in rows))
            assert Packing(max_tokens).rows(n, s) == want, (n, s)


# the example runs bf16_autocast with activation checkpointing: each block's fp32 input is kept
@pytest.mark.parametrize("attention, padded_gib, packed_gib", [("flash", 12.00, 14.41),
                                                               ("eager", 12.22, 14.93)])
def test_plan_counts_the_packed_rows(attention, padded_gib, packed_gib):
    """The printed text activations are the memory model's bytes for the packed rows (figures
    pinned) plus autocast's bf16 weight copies (the same for both); padded samples keep their
    own figure."""
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.memory import weight_cast_bytes

    rf, padded = load_run_file(EXAMPLE, PACKED), load_run_file(EXAMPLE, FIVE)
    config = rf.dhp_config(with_processor=False).model_config()
    s = settings_of(rf, attention)
    tc, tp = config.text_config, 8
    want = text_activation_bytes(tc, 9216, tp, s, 3072)
    assert round(want / GIB, 2) == packed_gib
    assert round(text_activation_bytes(tc, 5 * 1536, tp, s, 1536) / GIB, 2) == padded_gib
    casts = weight_cast_bytes(config, count_params(config), tp, s)
    cast_gib = (casts.text + casts.text_recomputed) / GIB  # lm_head's shard + one block's
    assert round(cast_gib, 2) == 0.29
    kw = dict(vision_tokens=[4096], text_tokens=512, attention=attention)
    text = plan_text(rf, **kw)
    (printed,) = _text_acts(text)  # two decimals
    assert abs(printed - (want / GIB + cast_gib)) < 0.006
    assert "packed (data.packing, rows of at most 4096 tokens)" in text
    (printed,) = _text_acts(plan_text(padded, **kw))
    assert abs(printed - (text_activation_bytes(tc, 5 * 1536, tp, s, 1536) / GIB + cast_gib)) < 0.006


def test_recommend_takes_the_packed_rows():
    """The recommender's memory for a layout takes the same packed rows (`Workload.packing`):
    the rank's estimate grows by exactly the packed rows' extra text activations (state bytes
    per parameter, no precision policy: no step-peak floor above the activations)."""
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Layout, Workload, memory_gib

    rf = load_run_file(EXAMPLE, PACKED)
    config = rf.dhp_config(with_processor=False).model_config()
    s = settings_of(rf, "flash")
    lay = Layout("collocated", "sequential", 8, 1, 8, 1)
    mem = [memory_gib(config, count_params(config), lay,
                      Workload(4096, 512, 5, 1, settings=s, packing=p))["vision+text"]
           for p in (None, Packing(4096))]
    tc = config.text_config
    grown = (text_activation_bytes(tc, 9216, 8, s, 3072)
             - text_activation_bytes(tc, 7680, 8, s, 1536)) / GIB
    assert round(grown, 2) == 2.40
    assert abs(mem[1] - mem[0] - grown) < 1e-9


def test_cost_model_counts_the_padded_tail_as_a_segment():
    """The cost model's text phase with packing: attention stays per sample (each sample's own
    segment, as without packing) and the rows' padded tail (3 x 3,072 - 5 x 1,536 = 1,536 tokens)
    adds its linears and its own segment's attention — and nothing else changes."""
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.cost_model import phase_times, text_flops
    from ray_dhp.planning.recommend import Hardware, Layout, Workload

    rf = load_run_file(EXAMPLE, PACKED)
    config = rf.dhp_config(with_processor=False).model_config()
    s, counts, hw = settings_of(rf, "flash"), count_params(config), Hardware()
    lay = Layout("collocated", "sequential", 8, 1, 8, 1)
    plain, packed = (phase_times(config, counts, lay, Workload(4096, 512, 5, 1, settings=s, packing=p), hw)
                     for p in (None, Packing(4096)))
    extra = text_flops(config, counts.text, 0, 1536, s) / 8 / hw.flops(s.dtype_bytes)
    assert packed.text > plain.text + extra  # + the all-reduces of the longer rows
    assert (packed.vision_fwd, packed.vision_bwd, packed.boundary) == \
        (plain.vision_fwd, plain.vision_bwd, plain.boundary)
    same = Workload(4096, 512, 4, 1, settings=s, packing=Packing(4096))  # 2 full rows: no tail
    assert phase_times(config, counts, lay, same, hw).text == \
        phase_times(config, counts, lay, Workload(4096, 512, 4, 1, settings=s), hw).text
