"""Fast checks of the balance benchmark's instruments (benchmarks/balance.py): no process group."""

import pytest

from benchmarks import balance as bb
from benchmarks.shapes import model_config


def test_mixed_steps_span_16x_with_text_only_and_the_plan_evens_them():
    config = model_config("vitheavy")
    steps = [bb.make_step(bb.MIX, config, k) for k in range(3)]
    patches = sorted({int(s.image_grid_thw.prod()) for st in steps for s in st
                      if s.image_grid_thw is not None})
    assert patches == [64, 256, 1024] and sum(s.image_grid_thw is None for s in steps[0]) == 4
    assert sum(bb.EQUAL) == sum(bb.MIX) and len(bb.EQUAL) == len(bb.MIX)
    imb = bb.model_imbalance(steps, config)
    assert all(c <= n for c, n in zip(imb["cost"]["vision"], imb["count"]["vision"]))
    assert max(imb["cost"]["vision"]) < 1.1 < max(imb["count"]["vision"])


def test_summarise_takes_the_slowest_rank_per_phase_and_replica_means():
    def m(vf, vb, t, wall):
        return {"cpu_vision_fwd_s": vf, "cpu_vision_bwd_s": vb, "cpu_return_grads_s": vb,
                "cpu_text_fwd_bwd_s": t, "wall_s": wall}
    # ranks 0,1 = vision replica 0 / text replica 0; ranks 2,3 = replica 1 (as vision DP2xSP2)
    per_rank = [{"vision": (i // 2, i % 2), "text": (i // 2, i % 2),
                 "steps": {"x": [m(*v)]}} for i, v in
                enumerate([(1, 2, 3, 9), (1, 2, 3, 8), (2, 4, 1, 7), (2, 4, 1, 7)])]
    s = bb.summarise(per_rank)["x"]
    assert s["wall_step_s_median"] == 9
    assert s["modelled_step_s_median"] == 2 + 3 + 4  # slowest vision fwd, text, return_grads
    assert s["vision_busy_s_per_replica_mean"] == [3, 6] and s["text_busy_s_per_replica_mean"] == [3, 1]
    assert s["vision_busy_imbalance_mean"] == pytest.approx(6 / 4.5)
    assert s["total_cpu_s_mean"] == 2 * (1 + 2 + 3) + 2 * (2 + 4 + 1)
    assert s["parallel_efficiency"] == pytest.approx(26 / (4 * 9))


def test_combine_takes_medians_over_repeats_and_ratios_compare_contenders():
    def rep(count, cost, one, equal):
        return {n: {"modelled_step_s_median": v, "vision_busy_s_per_replica_mean": [v, 2 * v],
                    "wall_s": [v]} for n, v in
                (("count", count), ("cost", cost), ("cost_1batch", one), ("equal", equal))}
    reps = [rep(4.0, 2.0, 3.0, 1.8), rep(5.0, 2.5, 3.5, 2.0), rep(4.4, 2.2, 9.0, 2.1)]
    s = bb.combine(reps)
    assert s["count"]["modelled_step_s_median"] == 4.4 and s["cost_1batch"]["modelled_step_s_median"] == 3.5
    assert s["cost"]["vision_busy_s_per_replica_mean"] == [2.2, 4.4]
    assert "wall_s" not in s["cost"]  # per-step lists stay in the repeats
    r = bb.ratios(reps[0])
    assert r["cost_vs_count"] == 2.0 and r["cost_vs_equal_sizes"] == pytest.approx(0.9)


def test_model_plans_pad_less_with_groups():
    config = model_config("vitheavy")
    steps = [bb.make_step(bb.MIX, config, k, 64) for k in range(2)]
    imb = bb.model_imbalance(steps, config)
    for k in range(2):  # groups run fewer padded tokens than one padded batch per replica
        assert (imb["cost"]["text_tokens_run_over_real"][k]
                < imb["cost_1batch"]["text_tokens_run_over_real"][k]
                <= imb["count"]["text_tokens_run_over_real"][k])
        assert max(imb["cost"]["text_calls"][k]) > 1 and imb["count"]["text_calls"][k] == [1, 1]
