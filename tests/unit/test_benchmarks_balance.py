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
