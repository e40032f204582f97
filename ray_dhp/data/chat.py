"""Rendering a conversation as prompt text, with the character spans of the replies to train.

Both renderers share one contract: ``render(messages, system_prompt) -> (text, spans)``.
``messages`` are ``(role, text)`` turns (roles system/user/assistant) whose user and system texts
hold ``<image>`` placeholders; ``text`` is the rendered conversation with one image-pad token
per image, which the caller expands to the image's pad count (`expand_pads`, as transformers'
processors do); ``spans`` are the ``[start, end)`` character ranges of each assistant reply: its
content and the end-of-turn token, not what the template writes after it (a newline). The
tokens are the family's (`ray_dhp.models.prompt_format.PromptFormat`).

* `TemplateRenderer`: the model's own chat template (the processor's or the tokenizer's
  ``chat_template``, rendered by ``tokenizer.apply_chat_template``), so the prompt is what the
  model was tuned on, e.g. the default system prompt of an instruct model's template. A
  reply is located by rendering the conversation up to it (ending with the generation prompt)
  and up to its end: both must be prefixes of the whole rendering, and the reply is what lies
  between them, up to and including the first end-of-turn token.
* `OwnFormat`: ray_dhp's own rendering in the family's turn markup (no default system prompt),
  used only when the processor has no chat template.

``system_prompt``: None = the template's default (our format: none); ``""`` = no system message
where the template allows it (a template that always writes one gets an empty one); any other text = that system message. A conversation with its own system turn keeps it.
"""

from __future__ import annotations

import re

__all__ = ["IMAGE_PLACEHOLDER", "VIDEO_PLACEHOLDER", "AUDIO_PLACEHOLDER", "ChatTemplateError", "TemplateRenderer",
           "OwnFormat", "expand_pads", "placeholder_kinds"]

IMAGE_PLACEHOLDER = "<image>"
VIDEO_PLACEHOLDER = "<video>"
AUDIO_PLACEHOLDER = "<audio>"  # a model with an audio encoder: `ray_dhp.data.audio`
_PLACEHOLDER = re.compile("(<image>|<video>|<audio>)")


class ChatTemplateError(ValueError):
    """The template renders this conversation in a way its replies cannot be located in (the
    record is then bad data: `ray_dhp.data.sample.BadSample`)."""


def _with_system(messages: list, system_prompt) -> list:
    """``messages`` with a leading system turn of ``system_prompt`` if it has none (and one is
    asked for: not None)."""
    if system_prompt is None or (messages and messages[0][0] == "system"):
        return list(messages)
    return [("system", system_prompt)] + list(messages)


def placeholder_kinds(messages: list) -> list:
    """``"image"`` / ``"video"`` / ``"audio"`` for each ``<image>`` / ``<video>`` / ``<audio>``
    placeholder of the non-assistant turns, in order (the order the model reads the items in)."""
    return [m[1:-1] for role, text in messages if role != "assistant"
            for m in _PLACEHOLDER.findall(text)]


def _content(role: str, text: str):
    """A chat message's content: the text itself, or (with ``<image>`` / ``<video>``
    placeholders) the list of image, video and text items the multimodal templates read."""
    if role == "assistant" or not _PLACEHOLDER.search(text):
        return text
    items = []
    for piece in _PLACEHOLDER.split(text):
        if piece in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER):
            items.append({"type": piece[1:-1]})
        elif piece:
            items.append({"type": "text", "text": piece})
    return items


class TemplateRenderer:
    """Renders with a Jinja chat template through ``tokenizer.apply_chat_template``.

    Args:
        tokenizer: the tokenizer that renders the template.
        chat_template: the template text.
        end_of_turn: the token that closes a reply (trained; what follows it is not): the
            family's (`PromptFormat.end_of_turn`) whatever the tokenizer's eos token is; None:
            the reply is all the template writes for the turn.
    """

    def __init__(self, tokenizer, chat_template: str, end_of_turn):
        self.tokenizer, self.chat_template, self.eos = tokenizer, chat_template, end_of_turn
        self._omits_system = None

    def text(self, messages: list, *, add_generation_prompt: bool = False) -> str:
        """The template's rendering of ``[(role, text)]`` (images as single pad tokens)."""
        from jinja2.exceptions import TemplateError

        conversation = [{"role": r, "content": _content(r, t)} for r, t in messages]
        try:
            return self.tokenizer.apply_chat_template(
                conversation, chat_template=self.chat_template, tokenize=False,
                add_generation_prompt=add_generation_prompt)
        except TemplateError as exc:  # e.g. a template's raise_exception("roles must alternate")
            raise ChatTemplateError(f"chat template: {type(exc).__name__}: {exc}") from exc

    def omits_system(self) -> bool:
        """Whether the template writes no system turn for a conversation without one (a template
        with a default system prompt writes it; then ``system_prompt=""`` becomes an empty
        system message)."""
        if self._omits_system is None:
            bare = self.text([("user", "x")])
            self._omits_system = self.text([("system", ""), ("user", "x")]).endswith(bare)
        return self._omits_system

    def render(self, messages: list, system_prompt=None) -> tuple[str, list]:
        if system_prompt == "" and self.omits_system():
            system_prompt = None
        messages = _with_system(messages, system_prompt)
        whole = self.text(messages)
        spans = []
        for i, (role, _) in enumerate(messages):
            if role != "assistant":
                continue
            if i == 0:
                raise ChatTemplateError("chat template: the conversation opens with an assistant "
                                        "turn; nothing renders the prompt before it")
            head = self.text(messages[:i], add_generation_prompt=True)
            upto = self.text(messages[:i + 1])
            if not (whole.startswith(upto) and upto.startswith(head)):
                raise ChatTemplateError(
                    f"chat template: the template renders the conversation up to turn {i + 1} "
                    "differently from the start of the whole conversation, so the reply's "
                    "tokens cannot be located")
            reply = upto[len(head):]
            end = reply.find(self.eos) if self.eos else -1
            spans.append((len(head), len(head) + (end + len(self.eos) if end >= 0 else len(reply))))
        return whole, spans


class OwnFormat:
    """ray_dhp's own rendering in a family's turn markup (``fmt``: its `PromptFormat`):
    ``turn_head`` + text + ``end_of_turn`` + ``turn_tail`` per turn, no default system prompt,
    each ``<image>`` / ``<video>`` / ``<audio>`` replaced in place by the format's item."""

    chat_template = None

    def __init__(self, fmt):
        self.fmt = fmt

    def render(self, messages: list, system_prompt=None) -> tuple[str, list]:
        parts, spans, pos = [], [], 0
        fmt = self.fmt
        for role, text in _with_system(messages, system_prompt or None):
            if role != "assistant":
                for ph in (IMAGE_PLACEHOLDER, VIDEO_PLACEHOLDER, AUDIO_PLACEHOLDER):
                    text = text.replace(ph, fmt.item(ph[1:-1]))
            head, body = fmt.turn_head.format(role=role), f"{text}{fmt.end_of_turn}"
            if role == "assistant":
                spans.append((pos + len(head), pos + len(head) + len(body)))
            parts.append(f"{head}{body}{fmt.turn_tail}")
            pos += len(parts[-1])
        return "".join(parts), spans


def expand_pads(text: str, spans: list, images: list, videos: list, audios: tuple,
                pads: tuple) -> tuple[str, list]:
    """Replace the i-th image pad of ``text`` by ``images[i]``, the i-th video pad by
    ``videos[i]`` and the i-th audio pad by ``audios[i]`` (the replacement strings) and move
    ``spans`` along. ``pads``: the image, video and audio placeholders the template writes
    (None: that kind has none; `PromptFormat.pads`, or a model's own processor's
    ``image_token``, `ray_dhp.data.model_processor`).

    Raises:
        ValueError: the text holds another number of image or video pads than there are items.
    """
    for pad, reps, what in zip(pads, (images, videos, audios), ("image", "video", "audio")):
        if pad is None:
            if reps:
                raise ValueError(f"the processor has no {what} placeholder for {len(reps)} {what}(s)")
            continue
        if text.count(pad) != len(reps):
            raise ValueError(f"the chat template rendered {text.count(pad)} {pad} token(s) for "
                             f"{len(reps)} {what}(s); the template must write one {pad} per "
                             f"{what} item ({{'type': '{what}'}}) of a message")
    todo = {pad: iter(reps) for pad, reps in zip(pads, (images, videos, audios)) if pad is not None}
    pieces = re.split("(" + "|".join(map(re.escape, todo)) + ")", text)
    cuts, pos, out = [], 0, []  # cuts: (pad's position, characters added)
    for piece in pieces:
        if piece in todo:
            rep = next(todo[piece])
            cuts.append((pos, len(rep) - len(piece)))
            out.append(rep)
        else:
            out.append(piece)
        pos += len(piece)
    moved = [(s + sum(d for p, d in cuts if p < s), e + sum(d for p, d in cuts if p < e))
             for s, e in spans]
    return "".join(out), moved
