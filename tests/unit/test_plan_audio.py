"""The audio encoder's group in the planner (`ray_dhp.planning.memory_audio`): clip tokens, the
activation model against the bytes autograd saves in the stock encoder, the per-rank state by
ZeRO stage, and `ray-dhp plan` on the Qwen2.5-Omni-7B example (three modules, disjoint)."""

import dataclasses

import pytest
import torch

from benchmarks.measure import ActivationCounter
from ray_dhp.cli.plan import plan_text
from ray_dhp.planning.memory import ActivationSettings, rank_state
from ray_dhp.models.sizes import count_params
from ray_dhp.planning.memory_audio import (AudioCounts, audio_activation_bytes, audio_rank_state,
                                           clip_shape, count_audio, estimate_module_ranks,
                                           module_rank_state, without_audio)
from ray_dhp.run_file import load_run_file
from ray_dhp.step.precision import policy_of
from ray_dhp.parallel.topology import EncoderDegrees, Topology

OMNI = "examples/qwen2_5_omni_7b_8gpu.yaml"


def _encoder(**dims):
    from transformers.models.qwen2_5_omni.configuration_qwen2_5_omni import (
        Qwen2_5OmniAudioEncoderConfig)
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import Qwen2_5OmniAudioEncoder

    c = Qwen2_5OmniAudioEncoderConfig(**dims)
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return c, Qwen2_5OmniAudioEncoder(c)


def test_clip_tokens_follow_the_stock_encoder():
    c, tower = _encoder(d_model=32, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=64,
                        n_window=100, output_dim=48)
    s = clip_shape(c, 30.0)  # Whisper: 100 frames/s -> 50 encoder tokens/s -> 25 LLM tokens/s
    assert (s.frames, s.tokens, s.lm_tokens, s.chunk_tokens) == (3000, 1500, 750, 100)
    for seconds in (0.37, 2.0, 7.51):
        s = clip_shape(c, seconds)
        after_cnn, out = tower._get_feat_extract_output_lengths(torch.tensor([s.frames]))
        assert (s.tokens, s.lm_tokens) == (int(after_cnn), int(out))


@pytest.mark.parametrize("seconds", [4.0, 3.3])  # whole chunks; a padded last chunk
def test_audio_activation_bytes_match_saved_tensors(seconds):
    """Tolerance 0.1 %: fp32, every tensor the encoder saves is one the model counts (measured
    equal to the byte on torch 2.13 CPU, SDPA)."""
    torch.set_num_threads(1)
    c, tower = _encoder(d_model=64, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=256,
                        n_window=50, output_dim=96)
    s = clip_shape(c, seconds)
    lens = torch.tensor([s.frames])
    feats = torch.randn(c.num_mel_bins, s.frames)
    counter = ActivationCounter()
    handles = counter.watch_vision(tower)
    with counter.count():
        out = tower(feats, feature_lens=lens,
                    aftercnn_lens=tower._get_feat_extract_output_lengths(lens)[0]).last_hidden_state
    out.square().mean().backward()
    for h in handles:
        h.remove()
    assert out.shape[0] == s.lm_tokens
    saved = counter.as_dict()["vision"]
    model = audio_activation_bytes(c, 1, seconds, ActivationSettings(4, "flash", False))
    assert abs(model / saved - 1) < 1e-3, (model, saved)
    assert audio_activation_bytes(c, 3, seconds, ActivationSettings(4, "flash", False)) == 3 * model
    ckpt = audio_activation_bytes(c, 1, seconds, ActivationSettings(4, "flash", True))
    assert ckpt < model


def test_audio_parameters_of_the_preset_match_the_closed_form():
    rf = load_run_file(OMNI)
    config = rf.dhp_config(with_processor=False).model_config()
    a = count_audio(config)
    h, i, mels, out, layers = 1280, 5120, 128, 3584, 32
    layer = 4 * h * h + 3 * h + 4 * h + 2 * h * i + i + h  # q/v/o biases (k has none), 2 LNs, fc1/fc2
    stem = mels * h * 3 + h + h * h * 3 + h + 2 * out + 2 * h + h * out + out  # convs, bos/eos, ln, proj
    assert a.params == layers * layer + stem and a.frozen == 0
    counts = count_params(config)
    assert without_audio(counts).text == counts.text - a.params  # the LM's own parameters
    assert count_audio(rf.dhp_config(with_processor=False).model_config().text_config) is None


def test_audio_state_by_zero_stage_and_collocated_sum():
    policy = policy_of(load_run_file(OMNI).precision)  # bf16_autocast: fp32 weights, no masters
    a = AudioCounts(params=1000, sizes=(400, 300, 300), largest=400)
    t0 = Topology.build(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1,
                        encoders={"audio": EncoderDegrees(dp=2, zero=0)})
    t1 = dataclasses.replace(t0, encoders=(t0.vision, dataclasses.replace(t0.encoder("audio"),
                                                                          zero_stage=1)))
    s0, s1 = (audio_rank_state(a, t.encoder("audio"), 1, policy) for t in (t0, t1))
    assert (s0.weights, s0.grads, s0.optimizer) == (4000, 4000, 8000)
    # ZeRO-1 over the 2 audio ranks (1, 2), greedy by size: rank 1 the 400, rank 2 both 300s
    assert s1.updated == 400 and s1.optimizer == 400 * 8 and s1.grads == 4000
    assert audio_rank_state(a, t1.encoder("audio"), 2, policy).updated == 600
    frozen = dataclasses.replace(a, frozen=1000, sizes=())
    assert audio_rank_state(frozen, t0.encoder("audio"), 1, policy).total == 4000  # weights only


def test_plan_prints_three_modules_and_fits():
    rf = load_run_file(OMNI)
    text = plan_text(rf, vision_tokens=[4096], text_tokens=512, audio_seconds=30.0)
    assert "parameters: vision 0.677 B, audio 0.640 B, text 7.616 B" in text
    assert "ZeRO stages: vision 1, audio 1, text 0" in text
    assert "1500 audio-encoder tokens (attention in chunks of 100), 750 + 2 LLM tokens" in text
    rows = [ln for ln in text.splitlines() if " memory: state " in ln]
    assert len(rows) == 8 and all(ln.endswith("[fits]") for ln in rows)
    audio_rows = [ln for ln in rows if "rank 2 " in ln or "rank 3 " in ln]
    assert all("audio act    0.00" not in ln for ln in audio_rows)
    assert "rank 4 [text]: vision 0.000 M + audio 0.000 M + text 1.904 B params" in text


def test_module_ranks_move_the_tower_off_the_text_ranks():
    rf = load_run_file(OMNI, ["placement=collocated", "vision.sequence_parallel=4",
                              "audio.data_parallel=4", "text.tensor_parallel=4"])
    dhp = rf.dhp_config(with_processor=False)
    topo, config = dhp.topology(), dhp.model_config()
    counts, a = count_params(config), count_audio(config)
    policy = policy_of(rf.precision)
    st = module_rank_state(counts, a, topo, 0, policy)
    base = rank_state(without_audio(counts), topo, 0, policy)
    extra = audio_rank_state(a, topo.encoder("audio"), 0, policy)
    assert st.total == base.total + extra.total and st.params == base.params + a.params
    s = ActivationSettings(2, "flash", True)
    kw = dict(vision_tokens=1024, text_tokens=256, samples=2, settings=s, policy=policy)
    rows = estimate_module_ranks(config, topo, counts, a, audio_seconds=10.0, **kw)
    plain = estimate_module_ranks(config, topo, counts, None, audio_seconds=10.0, **kw)
    assert rows[0].audio_act > 0 and plain[0].audio_act == 0
    assert rows[0].text_act > plain[0].text_act  # 10 s of audio: 250 + 2 more LLM tokens


def test_nodes_view_lists_the_audio_collectives():
    from ray_dhp.cli.plan import nodes_text
    from ray_dhp.planning.traffic import collective_groups

    rf = load_run_file(OMNI)
    text = nodes_text(rf, nodes=2, gpus_per_node=4, vision_tokens=4096, text_tokens=512,
                      audio_seconds=30.0)
    assert "1264 text tokens (with the audio rows), 30 s of audio" in text  # 512 + 750 + 2
    lines = {ln.split()[0] + " " + ln.split()[1]: ln for ln in text.splitlines() if ln.startswith("  audio")}
    assert "inside a node" in lines["audio gradients"]  # audio ranks 2, 3 on node 0
    assert "CROSSES nodes 0|1" in lines["audio boundary"]  # to the text ranks on node 1
    groups = collective_groups(rf.dhp_config(with_processor=False).topology(), 2)
    assert groups["audio gradients"] == [[2, 3]]
    assert groups["audio boundary"] == [[2, 4, 5, 6, 7], [3, 4, 5, 6, 7]]


@pytest.mark.parametrize("precision", ["fp32", "bf16_mixed", "bf16"])
@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, False), (1, True)])
def test_audio_state_is_the_vision_state_of_the_same_parameters(precision, stage, offload):
    """The audio group's state follows the vision side's rules (`rank_state`): the same
    parameters as a ViT on a group of the same size and stage give the same bytes."""
    from ray_dhp.models.sizes import ParamCounts
    from ray_dhp.step.precision import POLICIES

    policy, sizes = POLICIES[precision], (400, 300, 200, 100)
    a = AudioCounts(params=1000, sizes=sizes, largest=400)
    as_vision = ParamCounts(vision=1000, text=0, text_sharded=0, vision_sizes=sizes, largest=400)
    audio_topo = Topology.build(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1,
                                encoders={"audio": EncoderDegrees(dp=3, zero=stage, offload=offload)})
    vision_topo = Topology.build(placement="disjoint", vision_dp=3, vision_sp=1, text_dp=1, text_tp=1,
                                 vision_zero=stage, vision_offload=offload)
    for k in range(3):
        got = audio_rank_state(a, audio_topo.encoder("audio"), 1 + k, policy, largest=400)
        want = rank_state(as_vision, vision_topo, k, policy)
        assert got == want, (k, got, want)


def test_omni_preset_matches_transformers_thinker_defaults():
    """transformers' ``Qwen2_5OmniThinkerConfig`` sub-config defaults are the released 7B dims
    (its docstrings name Qwen/Qwen2.5-Omni-7B), except the ViT width: the class keeps 3584 (the
    LM width) as ``hidden_size`` while the released tower is 1280 wide (0.68 B parameters, the
    Qwen2.5-VL ViT's; 3584 would make a 5 B tower)."""
    from transformers import Qwen2_5OmniThinkerConfig

    from ray_dhp.cli.models import config_from_dims
    from ray_dhp.cli.presets import preset_dims

    got, ref = config_from_dims(preset_dims("qwen2_5_omni", "7b")), Qwen2_5OmniThinkerConfig()
    keys = {"audio_config": ("d_model", "encoder_layers", "encoder_attention_heads",
                             "encoder_ffn_dim", "n_window", "output_dim", "num_mel_bins",
                             "max_source_positions"),
            "vision_config": ("depth", "intermediate_size", "num_heads", "fullatt_block_indexes",
                              "window_size", "patch_size", "spatial_merge_size",
                              "temporal_patch_size", "out_hidden_size", "hidden_act"),
            "text_config": ("hidden_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "intermediate_size", "vocab_size")}
    for sub, names in keys.items():
        for k in names:
            assert list(_tuple(getattr(getattr(got, sub), k))) == list(_tuple(getattr(getattr(ref, sub), k))), (sub, k)
    assert got.vision_config.hidden_size == 1280
    for k in ("audio_token_id", "image_token_id", "video_token_id", "audio_start_token_id",
              "audio_end_token_id", "position_id_per_seconds"):
        assert getattr(got, k) == getattr(ref, k), k


def _tuple(v):
    return v if isinstance(v, (list, tuple)) else (v,)


def test_cli_plan_takes_the_clip_length(capsys):
    from ray_dhp.cli import main

    assert main(["plan", OMNI, "--audio-seconds", "10"]) == 0
    out = capsys.readouterr().out
    assert "one 10 s clip per sample" in out and "500 audio-encoder tokens" in out
    assert main(["plan", OMNI, "--audio-seconds", "0"]) == 2  # a configuration error
    assert "--audio-seconds 0: give a positive" in capsys.readouterr().err
