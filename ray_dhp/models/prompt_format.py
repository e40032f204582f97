"""How the prompts of a family whose samples ray_dhp makes itself are written, as data.

The hand-written families (``FamilySpec.model_processor`` False) train on samples made by
`ray_dhp.data.processing.VLProcessor` from a tokenizer, an image processor and (where the
directory has one) a chat template; everything that processor must know about the family's
prompts is one `PromptFormat`: its special and placeholder tokens, the turn markup of ray_dhp's
own format (used without a chat template), how a video's frame groups are written with their
timestamps, which processor classes write them, the image processor that loads without
torchvision and the resize rule of its image processor. `QWEN_VL` is the format of every
hand-written family (the Qwen-VL line, Qwen2.5-Omni's thinker and InternVL, whose LM speaks it);
it is `FamilySpec.prompt_format`'s default.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, replace

__all__ = ["PromptFormat", "VideoRules", "QWEN_VL", "QWEN3_OMNI", "DEFAULT_PROMPT_FORMAT"]


def _attr(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class VideoRules:
    """How a family's reference preprocessing samples and sizes a video's frames
    (`ray_dhp.data.video`), in ``unit = patch * merge`` pixels per side where it says units.

    Args:
        frame_factor: sampled frame counts are multiples of it (the temporal patch).
        min_tokens / max_tokens: default per-frame area bounds, in ``unit**2`` areas.
        seq_len, budget: the default whole-video area, ``seq_len * budget`` ``unit**2`` areas.
        min_growth: the per-frame cap never goes below ``min_growth`` x the lower bound.
        max_ratio: the largest aspect ratio a frame may have.
        image_factor: a list of frame images is resized as images, to multiples of
            ``image_factor * unit``, with areas in ``[image_min, image_max]``
            ``(image_factor * unit)**2`` areas by default.
    """

    frame_factor: int
    min_tokens: int
    max_tokens: int
    seq_len: int
    budget: float
    min_growth: float
    max_ratio: float
    image_factor: int
    image_min: int
    image_max: int


@dataclass(frozen=True)
class PromptFormat:
    """A family's prompt conventions (module docstring).

    Args:
        tokenizer_kind: the tokenizer the format needs, as error messages name it.
        special: ``((name, token), ...)`` the tokenizer must have (`VLProcessor.ids` by name);
            among the names, ``image_pad`` and ``video_pad`` (the rows' placeholders).
        config_ids: ``((name in special, the model config's id field), ...)`` that must agree.
        pads: the image, video and audio placeholder each item's pad repeats (None: no such).
        items: ``((placeholder kind, text), ...)``: how ray_dhp's own format writes an
            ``<image>`` / ``<video>`` / ``<audio>`` item (a template writes its own).
        turn_head: the text opening a turn (``{role}`` filled in) in ray_dhp's own format.
        end_of_turn: the token closing a reply (trained; a template's reply ends at it too).
        turn_tail: what follows ``end_of_turn`` in ray_dhp's own format (not trained).
        reserved: further strings no turn may contain (besides ``special`` and the pad token).
        text_end: reserved in place of the tokenizer's pad token when it has none.
        timed_frame: one temporal patch of a video when timestamps are written (``{t}`` its
            time in seconds, ``{pads}`` its pads).
        timestamp_processors: ``processor_class`` prefixes of the processors that write them.
        image_processor_fallback: ``module:Class`` of the image processor to load when
            ``AutoImageProcessor`` does not (it needs no torchvision).
        resize_rule: ``module:function`` of the image processor's resize rule,
            ``(height, width, factor=, min_pixels=, max_pixels=) -> (height, width)``.
        video: how videos are sampled and sized (`VideoRules`).
        audio_rows: ``module:function`` of the audio pads a clip of ``frames`` feature columns
            takes (the rows the model's audio encoder makes of it, as its processor counts them).
    """

    tokenizer_kind: str
    special: tuple
    config_ids: tuple
    pads: tuple
    items: tuple
    turn_head: str
    end_of_turn: str
    turn_tail: str
    reserved: tuple
    text_end: str
    timed_frame: str
    timestamp_processors: tuple
    image_processor_fallback: str
    resize_rule: str
    video: VideoRules
    audio_rows: str = "ray_dhp.models.qwen2_5_omni:audio_tokens"

    def clip_rows(self, frames) -> int:
        """Audio pads of a clip of ``frames`` feature columns (`audio_rows`)."""
        return int(_attr(self.audio_rows)(frames))

    def token(self, name: str) -> str:
        """The special token called ``name`` (`special`)."""
        return dict(self.special)[name]

    def item(self, kind: str) -> str:
        """How ray_dhp's own format writes an item of placeholder kind ``kind``."""
        return dict(self.items)[kind]

    def renders_timestamps(self, processor_class: str) -> bool:
        """Whether a processor of ``processor_class`` writes a video's frame timestamps."""
        return processor_class.startswith(self.timestamp_processors)

    def timed_frames(self, times, pad: str) -> str:
        """A video's text with timestamps: one `timed_frame` per temporal patch time."""
        return "".join(self.timed_frame.format(t=t, pads=pad) for t in times)

    def fallback_image_processor(self):
        """The image processor class to load when ``AutoImageProcessor`` does not."""
        return _attr(self.image_processor_fallback)

    def resize(self, height: int, width: int, *, factor: int, min_pixels: int,
               max_pixels: int) -> tuple:
        """The image processor's resized ``(height, width)`` of an image (`resize_rule`)."""
        return _attr(self.resize_rule)(height, width, factor=factor, min_pixels=min_pixels,
                                       max_pixels=max_pixels)


QWEN_VL = PromptFormat(
    tokenizer_kind="a Qwen-VL tokenizer",
    special=(("im_start", "<|im_start|>"), ("im_end", "<|im_end|>"),
             ("vision_start", "<|vision_start|>"), ("vision_end", "<|vision_end|>"),
             ("image_pad", "<|image_pad|>"), ("video_pad", "<|video_pad|>")),
    config_ids=(("image_pad", "image_token_id"), ("video_pad", "video_token_id"),
                ("vision_start", "vision_start_token_id"), ("vision_end", "vision_end_token_id")),
    pads=("<|image_pad|>", "<|video_pad|>", "<|AUDIO|>"),
    items=(("image", "<|vision_start|><|image_pad|><|vision_end|>"),
           ("video", "<|vision_start|><|video_pad|><|vision_end|>"),
           ("audio", "<|audio_bos|><|AUDIO|><|audio_eos|>")),  # as Qwen2.5-Omni's template writes a clip
    turn_head="<|im_start|>{role}\n",
    # Qwen's <|im_end|> whatever the tokenizer's eos token is (base Qwen2-VL checkpoints name
    # <|endoftext|> as eos)
    end_of_turn="<|im_end|>",
    turn_tail="\n",
    reserved=("<|AUDIO|>", "<|audio_bos|>", "<|audio_eos|>"),
    text_end="<|endoftext|>",
    timed_frame="<{t:.1f} seconds><|vision_start|>{pads}<|vision_end|>",  # Qwen3-VL's processor
    timestamp_processors=("Qwen3VL", "Qwen3_5"),
    image_processor_fallback=("transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:"
                              "Qwen2VLImageProcessorPil"),
    resize_rule="transformers.models.qwen2_vl.image_processing_pil_qwen2_vl:smart_resize",
    # qwen-vl-utils' fetch_video (0.0.14): FRAME_FACTOR, VIDEO_MIN/MAX_TOKEN_NUM, MODEL_SEQ_LEN
    # (total_pixels = 0.9 of it), max_pixels >= 1.05 min_pixels, MAX_RATIO; frame lists resized
    # as images with IMAGE_FACTOR 2 x unit and their MIN/MAX_TOKEN_NUM 4 / 16384
    video=VideoRules(frame_factor=2, min_tokens=128, max_tokens=768, seq_len=128000, budget=0.9,
                     min_growth=1.05, max_ratio=200, image_factor=2, image_min=4, image_max=16384),
)

#: Qwen3-Omni's thinker: Qwen-VL's format with its own audio tokens (a clip is
#: ``<|audio_start|><|audio_pad|>...<|audio_end|>``, as its processor writes it) and its audio
#: encoder's row count (13 rows per 100 feature frames, the tail by the conv strides)
QWEN3_OMNI = replace(
    QWEN_VL, pads=("<|image_pad|>", "<|video_pad|>", "<|audio_pad|>"),
    items=(*QWEN_VL.items[:2], ("audio", "<|audio_start|><|audio_pad|><|audio_end|>")),
    reserved=("<|audio_pad|>", "<|audio_start|>", "<|audio_end|>"),
    audio_rows="ray_dhp.models.qwen3_omni_moe:audio_tokens")

#: the format of every hand-written family (`FamilySpec.prompt_format`'s default)
DEFAULT_PROMPT_FORMAT = QWEN_VL
