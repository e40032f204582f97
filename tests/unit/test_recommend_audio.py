"""The recommender with three modules (`ray_dhp.planning.cost_audio`): how many workers for
audio, vision and text; the schedule terms; proposals that `DHPConfig` accepts; the CLI."""

import pytest
import yaml

from ray_dhp import demo
from ray_dhp.cli import main
from ray_dhp.cli.models import config_from_dims
from ray_dhp.cli.presets import preset_dims
from ray_dhp.layout import DHPConfig, ModuleParallel
from ray_dhp.planning.cost_types import Layout, PhaseTimes
from ray_dhp.planning.cost_model import schedule_time, step_time
from ray_dhp.planning.memory import ActivationSettings
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.memory_audio import count_audio, lm_audio_tokens
from ray_dhp.planning.recommend import Workload, enumerate_layouts, recommend
from ray_dhp.run_file import run_file_from_dict

BF16_CKPT = ActivationSettings(dtype_bytes=2, attention="flash", checkpointing=True)


@pytest.fixture(scope="module")
def omni_small_lm():
    """Qwen2.5-Omni-7B's ViT and audio encoder with a 0.5B-class LM (hidden 896, 24 layers):
    the three modules' FLOPs are of similar size, so clip length and image size decide."""
    dims = preset_dims("qwen2_5_omni", "7b")
    dims["text_config"].update(hidden_size=896, num_hidden_layers=24, num_attention_heads=14,
                               num_key_value_heads=2, intermediate_size=4864)
    dims["vision_config"]["out_hidden_size"] = dims["audio_config"]["output_dim"] = 896
    config = config_from_dims(dims)
    return config, count_params(config), count_audio(config)


def _best(config, counts, audio, vision_tokens, seconds):
    # memory is not the question (device_gib huge); 96 samples in 4 micro-batches of 24
    w = Workload(vision_tokens, 256 + lm_audio_tokens(config, seconds), 96, 4, BF16_CKPT,
                 device_gib=1e6, audio_seconds=seconds, audio_params=audio)
    cands = recommend(config, 8, w, counts=counts)
    assert all(c.layout.audio_dp >= 1 for c in cands)  # every candidate has an audio group
    best = next(c for c in cands if c.feasible and c.layout.placement == "disjoint")
    lay = best.layout
    return lay.vision_sp * lay.vision_dp, lay.audio_dp, lay.text_tp * lay.text_dp, best


def test_longer_clips_get_more_audio_workers(omni_small_lm):
    by_seconds = [_best(*omni_small_lm, 4096, s)[1] for s in (2, 30, 120)]
    assert by_seconds == sorted(by_seconds) and by_seconds[-1] > by_seconds[0], by_seconds
    nv_big, na_big, _, _ = _best(*omni_small_lm, 4096, 120)
    nv_small, na_small, _, best = _best(*omni_small_lm, 1024, 120)
    assert nv_small <= nv_big and na_small >= na_big  # smaller images: vision gives workers up
    assert set(best.idle_fraction) == {"vision", "audio", "text"}


def test_step_time_adds_encoders_collocated_and_overlaps_them_disjoint():
    p = PhaseTimes(vision_fwd=1.0, vision_bwd=2.0, text=4.0, boundary=0.1, vision_end=0.5,
                   text_end=0.7, vision_comm=0.0, text_comm=0.0, audio_fwd=3.0, audio_bwd=1.0,
                   audio_boundary=0.2, audio_end=0.9)
    col = Layout("collocated", "sequential", 1, 2, 1, 2, audio_dp=2)
    step, idle = step_time(col, p, 3)
    assert step == pytest.approx(3 * (1 + 3 + 2 + 1 + 4 + 2 * 0.3) + 0.5 + 0.9 + 0.7)
    assert idle == {"vision+audio+text": 0.0}
    dis = Layout("disjoint", "pipelined", 1, 1, 1, 1, audio_dp=1)
    step, idle = step_time(dis, p, 3)
    assert step == pytest.approx(schedule_time("pipelined", 3, 3.0, 2.0, 4.0, 0.3) + 0.9)
    assert idle["audio"] < idle["vision"]  # audio's forward is the longer encoder stage here


def test_three_module_proposals_pass_dhp_config_validation():
    config = demo.tiny_model_config("qwen2_5_omni")
    lays = enumerate_layouts(4, 2, config, audio=True)
    assert {lay.placement for lay in lays} == {"collocated", "disjoint"}
    assert all(lay.audio_dp == 4 for lay in lays if lay.placement == "collocated")
    for lay in lays:
        if lay.vision_sp > 1 and 4 % lay.vision_sp:
            continue
        try:
            cfg = DHPConfig(model=config, vision=ModuleParallel(sequence_parallel=lay.vision_sp,
                                                                data_parallel=lay.vision_dp),
                            audio=ModuleParallel(data_parallel=lay.audio_dp),
                            text=ModuleParallel(tensor_parallel=lay.text_tp, data_parallel=lay.text_dp,
                                                sequence_parallel=lay.text_sp),
                            placement=lay.placement)
        except ValueError as e:  # only the model's dims may refuse a proposal
            assert "must divide" in str(e), e
            continue
        assert cfg.topology() == lay.topology() and cfg.num_workers == 4


def test_cli_recommend_prints_the_audio_fragment(capsys, tmp_path):
    data = {"model": {"demo": "qwen2_5_omni"}, "audio": {"data_parallel": 1},
            "placement": "disjoint", "optim": {"global_batch_size": 4, "micro_batches": 2}}
    path = tmp_path / "omni.yaml"
    path.write_text(yaml.safe_dump(data))
    assert main(["plan", str(path), "--recommend", "--gpus", "4", "--audio-seconds", "4",
                 "--vision-tokens", "256", "--text-tokens", "32"]) == 0
    out = capsys.readouterr().out
    assert "one 4 s audio clip (102 LLM tokens)" in out and "ZeRO v/a/t" in out
    frag = yaml.safe_load(out.split("Run-file fragment:", 1)[1])
    assert frag["audio"]["data_parallel"] >= 1 and frag["scaling"]["num_workers"] == 4
    rf = run_file_from_dict({**data, **frag})  # the fragment is a valid layout of the run file
    assert rf.dhp_config(with_processor=False).topology().encoder("audio").dp == frag["audio"]["data_parallel"]
