"""The Qwen-Omni thinkers' audio tower as an encoder module of its own (`EncoderSpec` operations):
Qwen2.5-Omni's Whisper-style tower and Qwen3-Omni's chunked-conv one, each the class of its
config's own modeling module (`tower_class`), run on the same collated clips.

The audio ranks run the tower on their samples' clips (`forward`: what the thinker's
``get_audio_features`` computes, `ray_dhp.models.qwen2_5_omni.audio_forward`); the rows cross
the boundary like vision rows (one row per ``<|AUDIO|>`` pad, samples in order, clips in
placeholder order). The text shard holds no tower: `install_slot` puts a parameter-free
`AudioSlot` in its place, `text_inputs` fills it, and the stock forward takes the received rows
through its own seam — ``get_audio_features`` asks the slot for the lengths and the rows, checks
their count, and ``masked_scatter``s them into the audio placeholders; the clips'
``feature_attention_mask`` still goes in, since the thinker's M-RoPE positions read the clip
lengths from it.
"""

from __future__ import annotations

import torch

from ray_dhp.models.qwen2_5_omni import audio_forward, audio_inputs

__all__ = ["SEQUENCE_PARALLEL", "dim", "rows", "tower_class", "empty_tower", "collate", "cost", "has_input", "plan",
           "local_rows", "inputs", "forward", "AudioSlot", "install_slot", "text_inputs",
           "zero3_refusal"]

SEQUENCE_PARALLEL = False  # data parallel only (its chunked attention is not split over ranks)


def dim(family, config) -> int:
    """Width of one audio row: the tower's projection into the LM."""
    return config.audio_config.output_dim


def has_input(sample) -> bool:
    return sample.audio_lengths is not None


def rows(family, config, sample) -> int:
    """Feature rows (audio pads) of ``sample``'s clips: the family's rule per clip
    (`ray_dhp.models.prompt_format.PromptFormat.clip_rows`, what the data side pads a clip with)."""
    if sample.audio_lengths is None:
        return 0
    return sum(family.prompt_format.clip_rows(n) for n in sample.audio_lengths.tolist())


def tower_class(audio_config):
    """The transformers class of the tower ``audio_config`` configures: the model class of its
    own modeling module whose ``config_class`` it is (``Qwen2_5OmniAudioEncoder``,
    ``Qwen3OmniMoeAudioEncoder``)."""
    import importlib

    from transformers import PreTrainedModel

    module = importlib.import_module(type(audio_config).__module__.replace(".configuration_",
                                                                           ".modeling_"))
    found = [c for c in vars(module).values() if isinstance(c, type)
             and issubclass(c, PreTrainedModel) and c.config_class is type(audio_config)]
    if len(found) != 1:
        raise ValueError(f"no single audio tower class for {type(audio_config).__name__} in "
                         f"{module.__name__}: {[c.__name__ for c in found]}")
    return found[0]


def empty_tower(audio_config):
    """The tower of ``audio_config`` on the meta device (its parameters' shapes only: what
    `ray-dhp plan` counts)."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return tower_class(audio_config)._from_config(audio_config, dtype=torch.float32)


def collate(samples) -> dict:
    """The model's audio inputs of a batch (`ray_dhp.models.qwen2_5_omni.audio_inputs`: the
    clips and their mask, only the mask where the features stay on the audio ranks, nothing
    without audio): what `ray_dhp.data.collate` adds to a batch."""
    return audio_inputs(samples)


def cost(sample, model=None) -> int:
    """Balancing cost of ``sample`` on the audio side: its feature frames (the tower's attention
    is windowed, so its work grows linearly with them; the vision cost ``model`` plays no part)."""
    return 0 if sample.audio_lengths is None else int(sample.audio_lengths.sum())


def plan(family, config, samples, sp: int, micro_batch=None):
    """A replica's plan (no split: ``sp`` is 1): None where none of its ``samples`` has audio,
    else the frames the stock forward pads every chunk to over the whole ``micro_batch`` (its
    longest chunk of ``2 * n_window`` frames or less; default ``samples``), which `forward`
    pads this replica's chunks to: the convs run over the padding, so the rows of a clip's
    last, shorter chunk depend on it (Qwen3-Omni's tower; Qwen2.5-Omni's makes the same rows
    either way, `tests/distributed/test_omni_audio.py`)."""
    if not any(has_input(s) for s in samples):
        return None
    return longest_chunk(config.audio_config, [s for s in micro_batch or samples if has_input(s)])


def longest_chunk(audio_config, samples) -> int:
    """The longest chunk (feature frames) the tower cuts the clips of ``samples`` into: clips
    are cut into chunks of ``2 * n_window`` frames, the last one shorter."""
    window = 2 * audio_config.n_window
    return max(min(n, window) for s in samples for n in s.audio_lengths.tolist())


def local_rows(plan, sp_rank: int, rows: torch.Tensor) -> torch.Tensor:
    return rows  # the replica's one rank computes them all


def inputs(samples) -> dict:
    """The collated clips of ``samples`` (`audio_inputs`)."""
    if any(s.audio_features is None for s in samples):
        raise RuntimeError("a sample this audio replica computes has no audio features here: the "
                           "loader routed them by another rule than the engine's (give StepLoader "
                           "the engine's balancer)")
    return audio_inputs(samples)


def forward(family, tower, inputs: dict, plan, dtype: torch.dtype, *, sp_rank: int = 0,
            sp_group=None, comm=None, sharded=None) -> torch.Tensor:
    """``[rows, output_dim]``: the tower on the collated clips (samples in order), their chunks
    padded as in the whole micro-batch's forward (``plan``: the frames; a zero clip of that
    many frames runs after them where none of this replica's chunks is as long, its rows
    dropped: chunks and attention windows never span two clips)."""
    feats, mask = inputs["input_features"].to(dtype=dtype), inputs["feature_attention_mask"]
    window = 2 * tower.config.n_window
    pad = int(plan) if int(mask.sum(-1).clamp(max=window).max()) < int(plan) else 0
    if pad:
        frames = max(mask.shape[1], pad)
        feats = torch.nn.functional.pad(feats, (0, frames - feats.shape[2], 0, 0, 0, 1))
        mask = torch.nn.functional.pad(mask, (0, frames - mask.shape[1], 0, 1))
        mask[-1, :pad] = 1
    out = audio_forward(tower, feats, mask)
    return out[:out.shape[0] - family.prompt_format.clip_rows(pad)] if pad else out


def zero3_refusal(family) -> str:
    return ("audio.zero_stage=3: ZeRO-3 (FSDP2) of the audio encoder is not covered yet; use "
            "audio.zero_stage 0-2.")


class AudioSlot(torch.nn.Module):
    """Stands in for the audio tower on a text shard: returns the rows received for the current
    forward (`text_inputs`), with the tower's own length rule where it has one (Qwen2.5-Omni's
    thinker asks its tower; Qwen3-Omni's uses a module function); holds no parameters."""

    def __init__(self, tower_class):
        super().__init__()
        self._lengths = getattr(tower_class, "_get_feat_extract_output_lengths", None)
        self.pending = None

    def _get_feat_extract_output_lengths(self, input_lengths):
        return self._lengths(self, input_lengths)  # arithmetic only: the stock rule

    def forward(self, input_features, feature_lens=None, aftercnn_lens=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        if self.pending is None:
            raise RuntimeError("the audio slot has no rows for this forward (text_inputs first)")
        out, self.pending = self.pending, None
        return BaseModelOutput(last_hidden_state=out)


def install_slot(family, model) -> None:
    """Replace the thinker's audio tower by an `AudioSlot` (the text shard keeps no tower)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.model.audio_tower = AudioSlot(type(inner.model.audio_tower))


def text_inputs(family, config, model, samples, feats: torch.Tensor, device) -> dict:
    """Hand the rows ``feats`` to the slot of ``model`` (a text shard) for its coming forward, and
    the keyword arguments that forward takes for the audio of ``samples``: the clips' mask
    (positions and the row count read the lengths from it) and a one-channel
    ``input_features`` of the same frames, which only routes the forward into its audio seam
    (the slot ignores the values). Empty without audio."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.model.audio_tower.pending = feats
    batch = audio_inputs(samples)
    if not batch:
        return {}
    mask = batch["feature_attention_mask"]
    return {"input_features": torch.zeros((mask.shape[0], 1, mask.shape[1]), device=device),
            "feature_attention_mask": mask.to(device)}
