"""Qwen2.5-Omni's audio tower as an encoder module of its own (`EncoderSpec` operations).

The audio ranks run the tower on their samples' clips (`forward`: what the thinker's
``get_audio_features`` computes, `ray_dhp.models.qwen2_5_omni.audio_forward`); the rows cross
the boundary like vision rows (one row per ``<|AUDIO|>`` pad, samples in order, clips in
placeholder order). The text shard holds no tower: `install_slot` puts a parameter-free
`AudioSlot` in its place, and the stock forward takes the received rows through its own seam —
``get_audio_features`` asks the slot for the lengths and the rows, checks their count, and
``masked_scatter``s them into the audio placeholders; the clips' ``feature_attention_mask``
still goes in, since the thinker's M-RoPE positions read the clip lengths from it.
"""

from __future__ import annotations

import torch

from ray_dhp.models.qwen2_5_omni import audio_forward, audio_inputs, audio_tokens

__all__ = ["dim", "rows", "cost", "has_input", "forward", "AudioSlot", "install_slot", "fill_slot",
           "text_inputs"]


def dim(config) -> int:
    """Width of one audio row: the tower's projection into the LM."""
    return config.audio_config.output_dim


def has_input(sample) -> bool:
    return sample.audio_lengths is not None


def rows(sample) -> int:
    """Feature rows (``<|AUDIO|>`` pads) of ``sample``'s clips."""
    if sample.audio_lengths is None:
        return 0
    return int(audio_tokens(sample.audio_lengths).sum())


def cost(sample) -> int:
    """Balancing cost of ``sample`` on the audio side: its feature frames (the tower's attention
    is windowed, so its work grows linearly with them)."""
    return 0 if sample.audio_lengths is None else int(sample.audio_lengths.sum())


def forward(tower, samples, dtype: torch.dtype, device) -> torch.Tensor:
    """``[rows, output_dim]``: the tower on the clips of ``samples`` (samples in order)."""
    if any(s.audio_features is None for s in samples):
        raise RuntimeError("a sample this audio replica computes has no audio features here: the "
                           "loader routed them by another rule than the engine's (give StepLoader "
                           "the engine's balancer)")
    batch = audio_inputs(samples)
    feats = batch["input_features"].to(device=device, dtype=dtype)
    return audio_forward(tower, feats, batch["feature_attention_mask"].to(device))


class AudioSlot(torch.nn.Module):
    """Stands in for the audio tower on a text shard: returns the rows received for the current
    forward (`fill_slot`), with the tower's own length rule; holds no parameters."""

    def __init__(self, tower_class):
        super().__init__()
        self._lengths = tower_class._get_feat_extract_output_lengths
        self.pending = None

    def _get_feat_extract_output_lengths(self, input_lengths):
        return self._lengths(self, input_lengths)  # arithmetic only: the stock rule

    def forward(self, input_features, feature_lens=None, aftercnn_lens=None, **kwargs):
        from transformers.modeling_outputs import BaseModelOutput

        if self.pending is None:
            raise RuntimeError("the audio slot has no rows for this forward (fill_slot first)")
        out, self.pending = self.pending, None
        return BaseModelOutput(last_hidden_state=out)


def install_slot(model) -> None:
    """Replace the thinker's audio tower by an `AudioSlot` (the text shard keeps no tower)."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.model.audio_tower = AudioSlot(type(inner.model.audio_tower))


def fill_slot(model, feats: torch.Tensor) -> None:
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner.model.audio_tower.pending = feats


def text_inputs(samples, device) -> dict:
    """The keyword arguments the thinker's forward takes for the audio of ``samples`` on a text
    shard: the clips' mask (positions and the row count read the lengths from it) and a
    one-channel ``input_features`` of the same frames, which only routes the forward into its
    audio seam (the slot ignores the values). Empty without audio."""
    batch = audio_inputs(samples)
    if not batch:
        return {}
    mask = batch["feature_attention_mask"]
    return {"input_features": torch.zeros((mask.shape[0], 1, mask.shape[1]), device=device),
            "feature_attention_mask": mask.to(device)}
