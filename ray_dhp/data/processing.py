"""Turning one LLaVA-format record into model inputs for the families whose samples ray_dhp
makes itself; the family's tokens and turn markup are its `ray_dhp.models.prompt_format.PromptFormat`.

The processor renders the conversation with the model's own chat template when the processor (or
its tokenizer) has one, else in ray_dhp's own rendering of the family's turn markup
(`ray_dhp.data.chat`); it knows exactly which characters belong to assistant replies, tokenizes
the whole text once with offsets, and labels the tokens inside those spans.

Conventions (HF, unshifted labels):

* ``labels`` are -100 everywhere except the assistant turns' content tokens and their closing
  end-of-turn token. The newline the template writes after it is *not* trained (the model
  should stop at the end-of-turn token); nor are turn headers, system/user turns, or image
  tokens. A token straddling the edge of an assistant span (possible only if the content starts
  with whitespace that merges with the header's newline) is left untrained.
* ``mm_token_type_ids`` follows transformers' ``ProcessorMixin.create_mm_token_type_ids``:
  1 at the image pad, 2 at the video pad, 0 elsewhere (the vision start/end tokens are text,
  0). M-RoPE models need it to build their positions.
* Each ``<image>`` placeholder becomes an image item of its message, which the template renders
  with one image pad; the pad is then repeated ``grid_t*grid_h*grid_w / merge**2`` times, as
  transformers' processors do.
* Each ``<video>`` placeholder becomes a video item, decoded and sampled by `ray_dhp.data.video`;
  its pad is repeated ``t*h*w / merge**2`` times, or, for processors that render frame
  timestamps (``video_timestamps``), replaced by one timed frame group per temporal patch
  (`PromptFormat.timed_frame`), ``t`` the mean time of its frames.
* A record's visual items (images and videos) are kept in placeholder order: ``pixel_values``
  and ``image_grid_thw`` of a `Sample` hold all of them (the vision tower computes a video like
  a series of images), ``modalities`` says which is which; `ray_dhp.data.collate` splits them
  into the model's image and video inputs.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from ray_dhp.data.chat import (AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER,
                               ChatTemplateError, OwnFormat, TemplateRenderer, expand_pads,
                               placeholder_kinds)
from ray_dhp.data.images import ImageError, load_image
from ray_dhp.data.reading import Record
from ray_dhp.data.sample import (IGNORE_INDEX, BadSample, Sample, _image_paths, _messages,
                                  item_fields)
from ray_dhp.data.video import VideoError, video_sources
from ray_dhp.models.prompt_format import DEFAULT_PROMPT_FORMAT

__all__ = ["VLProcessor", "as_vl_processor", "pick_template"]

# the placeholder kinds (`placeholder_kinds`) whose items the vision side computes
VISUAL_KINDS = ("image", "video")


def pick_template(chat_template, owner):
    """The chat template to render with: ``chat_template``, else ``owner``'s (a processor's or a
    tokenizer's ``chat_template``); of several named templates, the default one."""
    template = chat_template or getattr(owner, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one
        template = template.get("default")
    return template


class VLProcessor:
    """Tokenizer + image processor for training samples (see module docstring).

    Args:
        tokenizer: a fast tokenizer with the format's special tokens (`PromptFormat.special`).
        image_processor: a resizing image processor (``patch_size``, ``merge_size``), or
            None for text-only data.
        system_prompt: system message of conversations that have none: None = the chat
            template's default (e.g. "You are a helpful assistant."; our own format: none),
            "" = none where the template allows it (else an empty one), text = that message.
        chat_template: the Jinja chat template to render with (default: the tokenizer's); with
            neither, ray_dhp's own rendering is used (`uses_chat_template` is then False).
        video: the frame sampling of videos (`ray_dhp.data.video.VideoSettings`).
        video_timestamps: render each video's frame groups with their timestamps
            (`load_processor` sets it for the processors that do, `PromptFormat`).
        feature_extractor: the audio feature extractor (a log-mel extractor), or None: records
            with ``"audio"`` are then bad samples.
        audio: how clips are read (`ray_dhp.data.audio.AudioSettings`).
        prompt_format: the family's `PromptFormat` (default: the hand-written families').
    """

    chat_source = None  # the file the chat template came from (`load_processor`), if known

    def __init__(self, tokenizer, image_processor=None, *, system_prompt: str | None = None,
                 chat_template: str | None = None, video=None, video_timestamps: bool = False,
                 feature_extractor=None, audio=None, prompt_format=None):
        from ray_dhp.data.audio import AudioSettings
        from ray_dhp.data.video import VideoSettings

        self.format = prompt_format if prompt_format is not None else DEFAULT_PROMPT_FORMAT
        #: the strings a rendered prompt holds once per image / video / audio item (`expand_pads`)
        self.pads = self.format.pads
        self.tokenizer, self.image_processor, self.system_prompt = tokenizer, image_processor, system_prompt
        self.video = replace(video if video is not None else VideoSettings(),
                             rules=self.format.video)
        self.video_timestamps = video_timestamps
        self.feature_extractor = feature_extractor
        self.audio = audio if audio is not None else AudioSettings()
        template = pick_template(chat_template, tokenizer)
        self.renderer = self._renderer(tokenizer, template)
        self.ids = self._token_ids(tokenizer)
        self.merge_size = getattr(image_processor, "merge_size", 2)

    def _renderer(self, tokenizer, template):
        if template:
            return TemplateRenderer(tokenizer, template, self.format.end_of_turn)
        return OwnFormat(self.format)

    def _token_ids(self, tokenizer) -> dict:
        special = self.format.special
        ids = {name: tokenizer.convert_tokens_to_ids(token) for name, token in special}
        for (name, token), tid in zip(special, ids.values()):
            if tid is None or tid == tokenizer.unk_token_id:
                raise ValueError(f"tokenizer has no {token} token; {self.format.tokenizer_kind} "
                                 "is required")
        return ids

    @property
    def uses_chat_template(self) -> bool:
        """Whether prompts are rendered with a chat template (False: our own rendering)."""
        return self.renderer.chat_template is not None

    def configured(self, *, system_prompt=None, min_pixels=None, max_pixels=None,
                   video=None) -> "VLProcessor":
        """A copy with this system prompt, the image processor resizing into
        ``[min_pixels, max_pixels]`` (None keeps the processor's limit;
        `ray_dhp.data.pixels.with_pixel_limits`) and these video settings (None: kept)."""
        from ray_dhp.data.pixels import with_pixel_limits

        out = VLProcessor(self.tokenizer, with_pixel_limits(self.image_processor, min_pixels, max_pixels),
                          system_prompt=system_prompt, chat_template=self.renderer.chat_template,
                          video=video if video is not None else self.video,
                          video_timestamps=self.video_timestamps,
                          feature_extractor=self.feature_extractor, audio=self.audio,
                          prompt_format=self.format)
        out.chat_source = self.chat_source
        return out

    def save_pretrained(self, directory) -> None:
        """Write the tokenizer (with the chat template in use) and image processor
        (``load_processor(directory)`` reads them back)."""
        tokenizer = self.tokenizer
        if self.uses_chat_template and tokenizer.chat_template != self.renderer.chat_template:
            import copy

            tokenizer = copy.copy(tokenizer)
            tokenizer.chat_template = self.renderer.chat_template
        tokenizer.save_pretrained(directory)
        if self.image_processor is not None:
            self.image_processor.save_pretrained(directory)
        if self.feature_extractor is not None:
            self.feature_extractor.save_pretrained(directory)

    @property
    def pad_token_id(self) -> int:
        """Id used to pad batches (the tokenizer's pad token)."""
        return self.tokenizer.pad_token_id

    def process(self, record, data_root, *, max_tokens: int | None = None,
                max_chars: int | None = None, max_pixels: int | None = None) -> Sample:
        """Build the :class:`Sample` of one record.

        Args:
            record: a :class:`~ray_dhp.data.reading.Record` (or a raw record dict, index 0).
            data_root: folder that relative image and video paths are resolved against.
            max_tokens: reject samples longer than this (no truncation: it would cut images).
            max_chars: reject records whose turns hold more characters than this, before
                tokenizing them (a runaway line would otherwise cost memory in the tokenizer).
            max_pixels: reject images (and video frames) with more pixels than this, from
                their header, before decoding them.

        Raises:
            BadSample: anything wrong with this one record: malformed record, missing, corrupt or
                too large image, an image the image processor refuses (e.g. an aspect ratio over
                200:1), text the tokenizer refuses (e.g. a lone surrogate), ``<image>`` count !=
                number of images, a missing, undecodable, audio-only or too short video (or
                one whose frames exceed ``max_pixels``), ``<video>`` count != number of videos,
                too many characters or tokens, or no trainable tokens.
                ``where`` names file and line. Other errors (a misconfigured tokenizer, a bug)
                are not about the record and propagate.
        """
        if not isinstance(record, Record):
            record = Record(0, record, "<dict>", 0)
        try:
            return self._process(record, Path(data_root), max_tokens, max_chars, max_pixels)
        except BadSample as exc:
            raise BadSample(exc.reason, record.where) from exc

    def _process(self, record: Record, data_root: Path, max_tokens, max_chars, max_pixels) -> Sample:
        if not record.ok:
            raise BadSample(record.error)
        if not isinstance(record.data, dict):
            raise BadSample("malformed record: not a JSON object")
        messages = self._validate(_messages(record.data))
        n_chars = sum(len(text) for _, text in messages)
        if max_chars is not None and n_chars > max_chars:
            raise BadSample(f"too long: {n_chars} characters > max_text_chars={max_chars} "
                            "(not tokenized)")
        kinds = placeholder_kinds(messages)
        paths = _image_paths(record.data, data_root)
        try:
            videos = video_sources(record.data, data_root, kinds.count("video"))
        except VideoError as exc:
            raise BadSample(str(exc)) from exc
        for what, have in (("image", paths), ("video", videos)):
            if kinds.count(what) != len(have):
                raise BadSample(f"{what} count mismatch: {kinds.count(what)} <{what}> "
                                f"placeholder(s) but {len(have)} {what}(s)")
        try:
            images = [load_image(p, max_pixels) for p in paths]
        except ImageError as exc:
            raise BadSample(str(exc)) from exc
        pixel_values, grid, image_pads, per_image = self.encode_images(images)
        clips = [self._encode_video(v, max_pixels) for v in videos]
        audio, audio_lengths, audio_pads = self._encode_audio(record.data, data_root, kinds)
        try:
            text, spans = self.renderer.render(messages, self.system_prompt)
        except ChatTemplateError as exc:
            raise BadSample(str(exc)) from exc
        text, spans = expand_pads(text, spans, image_pads, [c[3] for c in clips], audio_pads,
                                  pads=self.pads)
        visual = self._in_placeholder_order([k for k in kinds if k in VISUAL_KINDS], pixel_values,
                                            grid, clips)
        items = item_fields(visual, per_image, self.merge_size)
        input_ids, labels = self._tokenize(text, spans)
        if max_tokens is not None and len(input_ids) > max_tokens:
            raise BadSample(f"too long: {len(input_ids)} tokens > max_tokens={max_tokens}")
        if not (labels != IGNORE_INDEX).any():
            raise BadSample("no trainable tokens: the conversation has no assistant turn")
        mm = self._token_types(input_ids)
        if audio_lengths is not None:
            self._mark_audio(input_ids, mm, audio_pads)
        rows = [] if visual[1] is None else items["item_rows"].tolist() if items else \
            [int(g.prod()) // self.merge_size**2 for g in visual[1]]
        for kind, name in ((1, "image"), (2, "video")):
            want = sum(n for n, k in zip(rows, visual[2].tolist()) if k == kind) if rows else 0
            if int((mm == kind).sum()) != want:
                raise ValueError(f"{name} tokens were merged or split by the tokenizer: "
                                 f"{int((mm == kind).sum())} for {want} feature rows; the "
                                 f"{name} placeholder must be a special token")
        return Sample(record.index, input_ids, labels, mm, *visual, audio, audio_lengths, **items)

    def _token_types(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``mm_token_type_ids``: 1 on the image rows' tokens, 2 on the video rows' (audio: 3,
        `_mark_audio`)."""
        mm = torch.zeros_like(input_ids)
        mm[input_ids == self.ids["image_pad"]] = 1
        mm[input_ids == self.ids["video_pad"]] = 2
        return mm

    def _mark_audio(self, input_ids, mm, audio_pads) -> None:
        """``mm_token_type_ids`` 3 at the audio pads (transformers' convention); their count
        must be the clips' token count."""
        pad = self.pads[2]
        hit = input_ids == self.tokenizer.convert_tokens_to_ids(pad)
        mm[hit] = 3
        if int(hit.sum()) != sum(p.count(pad) for p in audio_pads):
            raise ValueError(f"audio-pad tokens were merged or split by the tokenizer; {pad} "
                             "must be a special token")

    def _encode_audio(self, data, data_root, kinds):
        from ray_dhp.data.audio import AudioError, record_audio

        try:
            return record_audio(data, data_root, kinds.count("audio"), self.feature_extractor,
                                self.audio, self.pads[2], self.format.clip_rows)
        except AudioError as exc:
            raise BadSample(str(exc)) from exc

    def _encode_video(self, source, max_pixels):
        from ray_dhp.data.video import VideoError, encode_video

        if self.image_processor is None:
            raise BadSample("no image processor: the record has videos but the processor has no "
                            "image processor")
        try:
            return encode_video(source, self.image_processor, self.video,
                                self.format if self.video_timestamps else None, max_pixels,
                                pad=self.pads[1])
        except VideoError as exc:
            raise BadSample(str(exc)) from exc

    @staticmethod
    def _in_placeholder_order(kinds, pixel_values, grid, clips):
        """``(pixel_values, grids, modalities, second_per_grid_ts)`` of the images and videos
        in placeholder order (None, None, None, None without any)."""
        if not kinds:
            return None, None, None, None
        n_patches = [] if grid is None else grid.prod(-1).tolist()
        image_rows = list(pixel_values.split(n_patches)) if n_patches else []
        images, videos, pv, grids = iter(zip(image_rows, grid if grid is not None else [])), iter(clips), [], []
        for kind in kinds:
            p, g = next(images) if kind == "image" else next(videos)[:2]
            pv.append(p)
            grids.append(g.reshape(1, 3))
        mods = torch.tensor([1 if k == "image" else 2 for k in kinds], dtype=torch.long)
        seconds = torch.tensor([c[2] for c in clips], dtype=torch.float64) if clips else None
        return torch.cat(pv), torch.cat(grids), mods, seconds

    def _reserved(self) -> list:  # strings no turn may contain (the prompt's control tokens)
        fmt = self.format
        return ([tok for _, tok in fmt.special] + [self.tokenizer.pad_token or fmt.text_end]
                + list(fmt.reserved))

    def _validate(self, messages: list[tuple[str, str]]) -> list[tuple[str, str]]:
        specials = self._reserved()
        for role, text in messages:
            hit = next((s for s in specials if s in text), None)
            if hit is not None:
                raise BadSample(f"malformed record: a {role} turn contains the special token {hit}")
            for ph in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER):
                if role == "assistant" and ph in text:
                    raise BadSample(f"malformed record: {ph} in an assistant turn")
        return messages

    def encode_images(self, images: list):
        """``(pixel rows, grids, pad strings, per image)`` of a record's images (Nones, ``[]``
        and ``{}`` without): each image's pad repeated once per feature row; ``per image``:
        ``{"image_sizes", "item_rows"}`` where the rows are not the grids' (`Sample`), else
        ``{}``."""
        if not images:
            return None, None, [], {}
        if self.image_processor is None:
            raise BadSample("no image processor: the record has images but the processor has no "
                            "image processor")
        try:
            out = self.image_processor(images=images, return_tensors="pt")
        except Exception as exc:  # e.g. ValueError: aspect ratio over 200 (the resize rule)
            raise BadSample(f"image processor refused the image(s): {type(exc).__name__}: "
                            f"{exc}") from exc
        grid = out["image_grid_thw"].to(torch.long)
        pads = [self.pads[0] * (n // self.merge_size**2) for n in grid.prod(-1).tolist()]
        return out["pixel_values"].to(torch.float32), grid, pads, {}

    def _tokenize(self, text: str, spans: list[tuple[int, int]]):
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception as exc:  # e.g. TypeError on a lone surrogate (text that is not UTF-8)
            raise BadSample(f"tokenizer refused the text: {type(exc).__name__}: "
                            f"{str(exc)[:200]}") from exc
        ids = torch.tensor(enc["input_ids"], dtype=torch.long)
        offsets = np.asarray(enc["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        trained = np.zeros(len(ids), dtype=bool)
        for start, end in spans:
            trained |= (offsets[:, 0] >= start) & (offsets[:, 1] <= end) & (offsets[:, 1] > offsets[:, 0])
        labels = torch.where(torch.from_numpy(trained), ids, torch.full_like(ids, IGNORE_INDEX))
        return ids, labels


def as_vl_processor(obj, prompt_format=None) -> VLProcessor:
    """Accept a :class:`VLProcessor`, a full transformers processor or a bare tokenizer (the
    new processor in ``prompt_format``: the family's `PromptFormat`, None: the default).

    A transformers processor (e.g. ``AutoProcessor.from_pretrained(local_dir)``) is recognised
    by its ``.tokenizer`` and ``.image_processor``; a bare tokenizer gives a text-only processor.
    """
    if isinstance(obj, VLProcessor):
        return obj
    if isinstance(obj, (str, os.PathLike)):
        return load_processor(os.fspath(obj), prompt_format)
    if hasattr(obj, "tokenizer") and hasattr(obj, "image_processor"):
        return VLProcessor(obj.tokenizer, obj.image_processor,
                           chat_template=getattr(obj, "chat_template", None),
                           prompt_format=prompt_format)
    if hasattr(obj, "convert_tokens_to_ids") and callable(obj):
        return VLProcessor(obj, None, prompt_format=prompt_format)
    raise TypeError(f"cannot use {type(obj).__name__} as a processor: pass a ray_dhp VLProcessor, "
                    "a transformers processor (with .tokenizer and .image_processor) or a tokenizer")


def load_processor(path: str, prompt_format=None) -> VLProcessor:
    """The processor of a local model directory: its tokenizer, image processor (None without
    ``preprocessor_config.json``) and the chat template found wherever transformers finds one,
    with or without torchvision (`ray_dhp.data.processor_dir`); ``chat_source`` names the
    template's file. ``prompt_format``: the family's `PromptFormat` (None: the default).

    Raises:
        ProcessorDirError: not a directory, no tokenizer files, a tokenizer or image processor
            that does not load, or a tokenizer without the format's special tokens.
    """
    from ray_dhp.data.processor_dir import ProcessorDirError, read_processor_dir, renders_timestamps

    fmt = prompt_format if prompt_format is not None else DEFAULT_PROMPT_FORMAT
    tokenizer, image_processor, template, source = read_processor_dir(path, fmt)
    try:
        processor = VLProcessor(tokenizer, image_processor, chat_template=template,
                                video_timestamps=renders_timestamps(path, fmt), prompt_format=fmt)
    except ValueError as e:  # a special token missing
        raise ProcessorDirError(f"processor directory {path}: {e}") from e
    processor.chat_source = source
    return processor
