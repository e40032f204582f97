"""`ray-dhp plan --nodes`' gradient traffic (`ray_dhp.planning.traffic.collective_bytes`) equals
the bytes the engine really sends, exactly, per precision policy: the gradient all-reduce
(vision, ZeRO 1) and reduce (text, ZeRO 2) buckets in the reduce dtype (fp32), and the owners'
broadcasts of the new weights in the weights' dtype — bf16 under ``bf16_mixed`` (its fp32
masters never leave their owner) and ``bf16``, fp32 under ``fp32`` (the old plan charged fp32
broadcasts always, and 2-byte gradients under ``bf16``). The engine's `CommCounter` records each
call's buffer bytes; the plan charges a ring all-reduce ``2 (n-1)/n`` and a reduce or broadcast
``(n-1)/n`` of them (n = 2 replicas here: exact binary fractions, so equality is exact).
"""

import pytest

from ray_dhp import demo
from ray_dhp.planning.cost_types import Layout, Workload
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.traffic import collective_bytes
from ray_dhp.step.precision import policy_of
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps, run_engine

FAMILY = "qwen2_5_vl"
LAYOUT = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1,
              vision_zero=1, text_zero=2)
WEIGHT_BYTES = {"bf16_mixed": 2, "bf16": 2, "fp32": 4}  # what the modules hold (the masters stay home)


@pytest.mark.parametrize("precision", ["bf16_mixed", pytest.param("fp32", marks=pytest.mark.slow),
                                       pytest.param("bf16", marks=pytest.mark.slow)])
def test_planned_zero_traffic_equals_sent_bytes(tmp_path, precision):
    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, seed=0, precision=precision)
    got = run_engine(FAMILY, LAYOUT, cfg, make_steps(tmp_path, FAMILY, cfg), None)
    config, policy = demo.tiny_model_config(FAMILY), policy_of(cfg.precision)
    counts = count_params(config)
    layout = Layout("collocated", "sequential", 1, 2, 1, 2, vision_zero=1, text_zero=2)
    plan = collective_bytes(config, counts, layout, Workload(1024, 64, 4, policy=policy,
                                                             state_bytes=policy.state_bytes()))
    weight = WEIGHT_BYTES[precision]
    for rank, out in enumerate(got["per_rank"]):
        sent = {k: v["bytes"] for k, v in out["comm"].items()}
        assert sent["broadcast/vision.zero"] == counts.vision * weight, (rank, sent)
        assert sent["broadcast/text.zero"] == counts.text * weight, (rank, sent)
        assert sent["all_reduce/vision.grads"] == counts.vision * 4, (rank, sent)
        assert sent["reduce/text.grads"] == counts.text * 4, (rank, sent)
        assert plan["vision gradients"] == sent["all_reduce/vision.grads"] + sent["broadcast/vision.zero"] / 2
        assert plan["text dp gradients"] == (sent["reduce/text.grads"] + sent["broadcast/text.zero"]) / 2
