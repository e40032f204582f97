"""`ray-dhp plan --recommend` with a resolution mix (``--vision-tokens 256:0.7,4096:0.25,...``)."""

from pathlib import Path

import pytest

from ray_dhp.cli import main
from ray_dhp.cli.models import config_from_dims
from ray_dhp.cli.presets import preset_dims
from ray_dhp.cli.recommend import parse_vision_tokens
from ray_dhp.cli.schema import ConfigError
from ray_dhp.planning.memory import ActivationSettings
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.recommend import Layout, Workload, phase_times, replica_share, vision_flops
from ray_dhp.planning.recommend import Hardware

ROOT = Path(__file__).resolve().parents[2]
BIG = str(ROOT / "examples" / "qwen2_5_vl_32b_8gpu.yaml")
MIX = ((256, 0.7), (4096, 0.25), (16384, 0.05))
BF16_CKPT = ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=True)


@pytest.fixture(scope="module")
def big():
    config = config_from_dims(preset_dims("qwen2_5_vl", "32b"))
    return config, count_params(config)


def test_parse_vision_tokens():
    assert parse_vision_tokens("4096") == ([4096], None)
    assert parse_vision_tokens("1024,4096") == ([1024, 4096], None)
    sizes, mix = parse_vision_tokens("4096:25, 256:70,16384:5")  # weights normalised, sorted
    assert sizes == [256, 4096, 16384]
    assert [v for v, _ in mix] == sizes and [round(f, 6) for _, f in mix] == [0.7, 0.25, 0.05]
    for bad in ("256:0.5,4096", "256:0", "256:a", "256:1,256:1", "0", ""):
        with pytest.raises(ConfigError, match="--vision-tokens"):
            parse_vision_tokens(bad)


def test_replica_share_of_a_mix(big):
    config, counts = big
    f = lambda vt: vision_flops(config, counts.vision, vt, BF16_CKPT)  # noqa: E731
    one = Workload(vision_tokens=4096, text_tokens=512, global_batch_size=8, micro_batches=1)
    assert replica_share(one, 2, f) == 4 * f(4096)  # one size: ceil(mb / dp) samples
    mix = Workload(vision_tokens=16384, text_tokens=512, global_batch_size=64, micro_batches=1,
                   vision_mix=MIX)
    mean = 64 * sum(w * f(v) for v, w in MIX) / 4
    assert replica_share(mix, 4, f) == pytest.approx(mean)  # many samples: the mean share
    # 16 replicas of 4 samples: a replica cannot split a 16k image, 96% of micro-batches hold one
    assert replica_share(mix, 16, f) == pytest.approx((1 - 0.95 ** 64) * f(16384))
    assert replica_share(mix, 1, f) == pytest.approx(64 * sum(w * f(v) for v, w in MIX))
    with pytest.raises(ValueError, match="sum to 1"):
        Workload(16384, 512, 8, vision_mix=((256, 0.5), (16384, 0.4)))
    with pytest.raises(ValueError, match="largest"):
        Workload(4096, 512, 8, vision_mix=MIX)


def test_a_mix_costs_between_its_smallest_and_largest_size(big):
    config, counts = big
    lay = Layout("collocated", "sequential", 8, 1, 8, 1)

    def vision_time(vt, mix=None):
        w = Workload(vision_tokens=vt, text_tokens=512, global_batch_size=8, micro_batches=1,
                     settings=BF16_CKPT, vision_mix=mix)
        p = phase_times(config, counts, lay, w, Hardware())
        return p.vision_fwd + p.vision_bwd, p.text

    v_mix, t_mix = vision_time(16384, MIX)
    v_small, t_small = vision_time(256)
    v_big, t_big = vision_time(16384)
    assert v_small < v_mix < v_big and t_small < t_mix < t_big


def test_cli_recommends_for_a_mix(capsys):
    assert main(["plan", BIG, "--recommend", "--gpus", "16", "--micro-batches", "4",
                 "--vision-tokens", "256:0.7,4096:0.25,16384:0.05", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "256 (70%), 4096 (25%), 16384 (5%) vision + 512 text tokens per sample" in out
    assert "memory planned for 16384" in out
    mix_best = out.split("recommended: ", 1)[1].split(" (", 1)[0]
    assert main(["plan", BIG, "--recommend", "--gpus", "16", "--micro-batches", "4",
                 "--vision-tokens", "16384", "--top", "3"]) == 0
    big_best = capsys.readouterr().out.split("recommended: ", 1)[1].split(" (", 1)[0]
    assert mix_best != big_best  # the mix is not planned as if every image were the largest
