"""Models with several encoders (Qwen2.5-Omni's thinker: audio + vision + LM), configuration side:
the ``audio=`` keyword / ``audio:`` section, the three-module topology it builds, driver errors."""

import pytest

from ray_dhp import DHPConfig, ModuleParallel, demo
from ray_dhp.cli.schema import ConfigError
from ray_dhp.run_file import load_run_file
from ray_dhp.parallel.topology import EncoderDegrees, Topology

TINY = "examples/tiny.yaml"


@pytest.fixture(scope="module")
def omni():
    return demo.tiny_model_config("qwen2_5_omni")


def test_audio_keyword_builds_a_three_module_collocated_topology(omni):
    cfg = DHPConfig(model=omni, audio=ModuleParallel(data_parallel=2),
                    vision=ModuleParallel(sequence_parallel=2), text=ModuleParallel(tensor_parallel=2))
    t = cfg.topology()
    assert [m.name for m in t.modules] == ["vision", "audio", "text"]
    a = t.encoder("audio")
    assert (a.dp, a.inner, a.offset, a.zero_stage) == (2, 1, 0, 1)  # ZeRO-1 default with 2 replicas
    assert t.roles(1) == ("vision", "audio", "text") and t.world_size == 2
    # the same topology Topology.build gives from the degrees directly (one code path)
    assert t == Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1,
                               text_tp=2, encoders={"audio": EncoderDegrees(dp=2)})
    assert cfg.to_dict()["audio"]["data_parallel"] == 2


def test_disjoint_three_modules_take_consecutive_blocks(omni):
    cfg = DHPConfig(model=omni, audio=ModuleParallel(data_parallel=3, zero_stage=2),
                    vision=ModuleParallel(sequence_parallel=2), placement="disjoint",
                    text=ModuleParallel(tensor_parallel=2, data_parallel=2))
    t = cfg.topology()
    assert [(m.name, m.ranks) for m in t.modules] == [
        ("vision", [0, 1]), ("audio", [2, 3, 4]), ("text", [5, 6, 7, 8])]
    assert t.encoder("audio").zero_stage == 2 and cfg.num_workers == 9
    with pytest.raises(ValueError, match=r"needs 9 workers \(vision 2 \+ audio 3 \+ text 4\)"):
        cfg.validate_workers(8)


def test_without_audio_the_layout_is_the_two_module_one(omni):
    cfg = DHPConfig(model=omni, vision=ModuleParallel(sequence_parallel=2),
                    text=ModuleParallel(tensor_parallel=2))
    assert cfg.audio is None and cfg.topology().encoder_names == ("vision",)
    assert "audio" not in cfg.to_dict()


@pytest.mark.parametrize("audio, match", [
    (ModuleParallel(sequence_parallel=2), r"audio.sequence_parallel=2: the audio encoder trains "
                                          r"data parallel only"),
    (ModuleParallel(data_parallel=2, zero_stage=3), r"audio.zero_stage=3: ZeRO-3 \(FSDP2\) of "
                                                    r"the audio encoder is not covered"),
    (ModuleParallel(tensor_parallel=2), r"audio.tensor_parallel: the audio group uses"),
    (ModuleParallel(expert_parallel=2), r"audio.expert_parallel: the audio encoder has no experts"),
    (ModuleParallel(data_parallel=3), r"collocated placement .* but audio uses 3x1=3"),
    ("two", r"DHPConfig.audio must be a ModuleParallel or None"),
])
def test_bad_audio_degrees_fail_in_the_driver(omni, audio, match):
    with pytest.raises(ValueError, match=match):
        DHPConfig(model=omni, audio=audio, vision=ModuleParallel(data_parallel=2),
                  text=ModuleParallel(data_parallel=2))


def test_audio_for_a_family_without_an_audio_encoder_is_refused():
    with pytest.raises(ValueError, match=r"audio: the qwen2_5_vl family has no audio encoder"):
        DHPConfig(model=demo.tiny_model_config(), audio=ModuleParallel())


def test_run_file_audio_section_is_optional_and_feeds_the_topology():
    rf = load_run_file(TINY, ["model.demo=qwen2_5_omni"])
    assert rf.audio is None and rf.to_dict()["audio"] is None
    assert rf.dhp_config(with_processor=False).audio is None
    rf = load_run_file(TINY, ["model.demo=qwen2_5_omni", "audio.data_parallel=2",
                              "audio.zero_stage=0"])
    assert (rf.audio.data_parallel, rf.audio.zero_stage) == (2, 0)
    t = rf.dhp_config(with_processor=False).topology()
    assert t.encoder("audio").mesh() == [[0], [1]] and t.encoder("audio").zero_stage == 0
    rf = load_run_file(TINY, ["model.demo=qwen2_5_omni", "audio={}", "placement=disjoint"])  # on
    assert rf.audio is not None and rf.audio.data_parallel == 1


@pytest.mark.parametrize("overrides, match", [
    (["audio.data_parallel=2"], r"^audio: the qwen2_5_vl family has no audio encoder"),
    (["model.demo=qwen2_5_omni", "audio.sequence_parallel=2"], r"^audio.sequence_parallel=2"),
    (["model.demo=qwen2_5_omni", "audio.tensor_parallel=2"],
     r"audio.tensor_parallel: unknown key; did you mean 'text.tensor_parallel'"),
    (["model.demo=qwen2_5_omni", "audio.data_parallel=0"], r"audio.data_parallel: .*>= 1"),
])
def test_run_file_audio_errors_name_the_key(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_run_file(TINY, overrides)
