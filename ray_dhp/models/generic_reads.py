"""What the generic family (`ray_dhp.models.generic`) reads from a transformers VLM's own source:
where the model's code reads a vision part outside the encoders' seams (`text_reads_vision`: a
text shard without the vision parts could not run the stock forward) and where it reads the
language model's input-embedding table outside the embedding (`text_reads_table`: a table not
whole on a rank is then served row by row); each found by scanning the methods of the model's
classes, its MRO up to torch's."""

from __future__ import annotations

import inspect

__all__ = ["text_reads_table", "text_reads_vision"]


def text_reads_vision(inner_cls, parts: tuple) -> str:
    """Where the model's own code reads a vision part outside the encoders' seams
    (``get_image_features`` / ``get_video_features``; ``__init__`` builds them), e.g. Ovis2.5's
    ``_merge_visual_features`` looking up its image start / end embeddings in the projector's
    table while the text forward runs: ``"Class.method: part"``, or "" (the text forward reads
    none, so a text shard without the vision parts runs the stock forward)."""
    import re

    for klass in inner_cls.__mro__:
        if klass.__module__.startswith("torch"):
            break
        for name, fn in vars(klass).items():
            if name in ("get_image_features", "get_video_features", "__init__") or not callable(fn):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            part = next((p for p in parts if re.search(rf"self\.{p}\b", src)), None)
            if part:
                return f"{klass.__name__}.{name}: {part}"
    return ""


def text_reads_table(inner_cls, lm_attr: str) -> str:
    """Where the model's own code reads the language model's input-embedding table outside the
    embedding (``self.<lm>.embed_tokens.weight``: Gemma 4's pad row for its per-layer inputs),
    ``"Class.method"``, or "": a vocabulary-parallel (text TP) or ZeRO-3-sharded table is not
    whole on a rank, and DTensor would gather all of it on every rank for that read."""
    import re

    pattern = rf"self\.{lm_attr}\.embed_tokens\.weight\b"
    for klass in inner_cls.__mro__:
        if klass.__module__.startswith("torch"):
            break
        for name, fn in vars(klass).items():
            if name == "__init__" or not callable(fn):
                continue
            try:
                src = inspect.getsource(fn)
            except (OSError, TypeError):
                continue
            if re.search(pattern, src):
                return f"{klass.__name__}.{name}"
    return ""
