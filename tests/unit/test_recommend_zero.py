"""`ray-dhp plan --recommend` considers ZeRO stages (`ray_dhp.planning.recommend.with_zero_stages`):
a layout that does not fit at its default stages is kept at the fastest stage pair that fits, its
predicted memory is the planner's at those stages, and the run-file fragment names them."""

from ray_dhp import demo
from ray_dhp.planning.cost_types import Layout
from ray_dhp.planning.memory import ActivationSettings
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.recommend import Workload, evaluate, recommend, zero_options
from ray_dhp.step.precision import POLICIES

BASE = Layout("collocated", "sequential", 1, 4, 1, 4)


def _workload(device_gib):
    return Workload(64, 32, 4, settings=ActivationSettings(dtype_bytes=2), device_gib=device_gib,
                    policy=POLICIES["bf16_mixed"])


def test_a_layout_that_fits_only_at_a_higher_stage_is_recommended_there():
    config = demo.tiny_model_config("qwen2_5_vl")
    counts = count_params(config)
    default = evaluate(config, counts, BASE, _workload(80.0)).peak_memory_gib
    s3 = evaluate(config, counts, Layout(**{**BASE.__dict__, "vision_zero": 2, "text_zero": 3}),
                  _workload(80.0)).peak_memory_gib
    assert s3 < default
    budget = (s3 + default) / 2  # the default (stage 1) does not fit, stage 3 does
    cands = recommend(config, 4, _workload(budget), counts=counts)
    got = next(c for c in cands if (c.layout.vision_sp, c.layout.vision_dp, c.layout.text_tp,
                                    c.layout.text_dp, c.layout.placement) == (1, 4, 1, 4, "collocated"))
    assert got.feasible and got.peak_memory_gib <= budget
    topo = got.layout.topology()
    assert (topo.vision.zero_stage, topo.text.zero_stage) != (1, 1)
    frag = got.layout.run_file_fragment()
    assert frag["text"]["zero_stage"] == topo.text.zero_stage
    assert frag["vision"]["zero_stage"] == topo.vision.zero_stage
    # the fastest of the variants that fit
    fits = [evaluate(config, counts, lay, _workload(budget)) for lay in zero_options(BASE)]
    assert got.step_s == min(c.step_s for c in fits if c.feasible)
    # with room to spare, the default stages stay
    roomy = recommend(config, 4, _workload(80.0), counts=counts)
    assert all(c.layout.vision_zero is None and c.layout.text_zero is None for c in roomy)


def test_zero_options_cover_the_admitted_pairs():
    pairs = {(lay.vision_zero, lay.text_zero) for lay in zero_options(BASE)}
    assert pairs == {(a, b) for a in (0, 1, 2, 3) for b in (0, 1, 2, 3)} - {(1, 1)}
    one = Layout("collocated", "sequential", 1, 1, 1, 1)  # one replica of each: stage 0 only
    assert zero_options(one) == []
    sp = Layout("collocated", "sequential", 4, 1, 4, 1)  # the SP ranks replicate the tower
    assert {(lay.vision_zero, lay.text_zero) for lay in zero_options(sp)} == {(0, 0), (2, 0), (3, 0)}
