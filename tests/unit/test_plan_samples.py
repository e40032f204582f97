"""`ray-dhp plan` counts each module's activations for the samples one of *its* replicas takes
(issue #42): with vision SP8 (one replica) beside text DP8, a micro-batch of 8 samples is 8 per
vision replica and 1 per text replica. It used to take the smaller DP for both modules and
counted the text activations of 8 samples (17.06 GiB instead of 2.13 GiB for 30B-A3B)."""

import os
import re

from ray_dhp.cli.plan import plan_text, samples_per_replica
from ray_dhp.run_file import load_run_file

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                       "examples", "qwen3_vl_30b_a3b_8gpu.yaml")


def _acts(text: str) -> list:
    return [tuple(float(x) for x in m) for m in re.findall(
        r"vision act +([\d.]+) GiB \+ text act +([\d.]+) GiB", text)]


def test_each_module_takes_its_own_share_of_the_micro_batch():
    vision_sp8 = ["vision.sequence_parallel=8", "vision.data_parallel=1",
                  "optim.global_batch_size=8", "optim.micro_batches=1"]
    rf = load_run_file(EXAMPLE, vision_sp8)
    assert samples_per_replica(rf, rf.dhp_config(with_processor=False).topology()) == {
        "vision": 8, "text": 1}
    one_each = load_run_file(EXAMPLE, ["vision.sequence_parallel=1", "vision.data_parallel=8",
                                       "optim.global_batch_size=8", "optim.micro_batches=1"])
    kw = dict(vision_tokens=[4096], text_tokens=512)
    sp8, dp8 = _acts(plan_text(rf, **kw)), _acts(plan_text(one_each, **kw))
    assert len(sp8) == len(dp8) == 8
    # the text group is the same (DP8, one sample per replica) in both layouts: same activations
    assert {t for _, t in sp8} == {t for _, t in dp8}
    assert "sample(s) per replica per micro-batch: vision 8, text 1" in plan_text(rf, **kw)
