"""Reading LLaVA-format annotation files (a JSON array or JSON lines) into records.

Reading never drops anything silently: a JSONL line that is not valid JSON (or not an object)
becomes a :class:`Record` flagged bad, with its file, line and reason, and the bad-data policy
of the caller decides whether to skip it or stop.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ray_dhp.data.index import index_file

__all__ = ["Annotations", "Record", "read_annotations", "resolve_data_root"]

_SUFFIXES = (".json", ".jsonl")


@dataclass
class Record:
    """One annotation entry and where it came from.

    Attributes:
        index: position in the list returned by :func:`read_annotations` (the dataset index).
        data: the parsed JSON object, or ``None`` when the entry is bad.
        source: the annotation file it was read from.
        line: 1-based line number for JSONL files, 0-based item index for JSON arrays.
        error: why the entry is bad (``None`` when it parsed as a JSON object).
        line_kind: ``"line"`` (JSONL) or ``"item"`` (JSON array): how to read ``line``.
    """

    index: int
    data: dict | None
    source: str
    line: int
    error: str | None = None
    line_kind: str = "line"

    @property
    def ok(self) -> bool:
        """True when the entry parsed as a JSON object."""
        return self.error is None

    @property
    def where(self) -> str:
        """Human-readable location, e.g. ``data.jsonl:12`` or ``data.json[item 3]``."""
        if self.line_kind == "line":
            return f"{self.source}:{self.line}"
        return f"{self.source}[item {self.line}]"


def _expand(path_or_paths) -> list[Path]:
    items = [path_or_paths] if isinstance(path_or_paths, (str, Path)) else list(path_or_paths)
    files: list[Path] = []
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.iterdir() if f.suffix in _SUFFIXES)
            if not found:
                raise FileNotFoundError(f"no .json/.jsonl annotation files in folder {p}")
            files.extend(found)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"annotation file not found: {p}")
    return files


def parse_record(raw: bytes, kind: str = "line") -> tuple[dict | None, str | None]:
    """``(data, None)`` for the bytes of one record, or ``(None, why it is bad)``: not UTF-8, not
    valid JSON, or not a JSON object (``kind``: "line" or "item", as the message names it)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"not UTF-8: byte {raw[exc.start]:#04x} at column {exc.start + 1}"
    try:
        item = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    if isinstance(item, dict):
        return item, None
    return None, f"not an object: {kind} is a {type(item).__name__}, not a JSON object"


class Annotations(Sequence):
    """The records of one or more annotation files, in file order, through their memory-mapped
    indexes (`ray_dhp.data.index`): ``len``, ``[i]`` (parses record ``i``, a `Record`),
    iteration. Small to keep and to pickle: 16 bytes a record, mapped, plus the file names."""

    def __init__(self, files: list):
        self.files = files
        self.offsets = np.cumsum([0] + [len(f) for f in files])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[k] for k in range(*i.indices(len(self)))]
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"record {i} of {n}")
        k = int(np.searchsorted(self.offsets, i, side="right")) - 1
        f = self.files[k]
        raw, line = f.raw(i - int(self.offsets[k]))
        data, error = parse_record(raw, f.line_kind)
        return Record(i, data, f.source, line, error, line_kind=f.line_kind)

    def __eq__(self, other):
        return isinstance(other, Sequence) and len(self) == len(other) and list(self) == list(other)

    __hash__ = None


def read_annotations(path_or_paths, index_dir=None) -> Annotations:
    """LLaVA-format annotations from JSON (one array) and/or JSONL (one object per line) files,
    as `Annotations`: each file is indexed once (`ray_dhp.data.index`) and a record is parsed
    only when it is asked for.

    The format comes from the file name: ``.jsonl`` is JSON lines, ``.json`` a JSON array (read
    as JSON lines when its content does not start with ``[``); other names are told apart by
    their content. JSON lines are split at ``\\n`` only (blank lines skipped; U+2028, U+0085,
    form feeds... inside a record are text) and decoded one by one: a line that is not UTF-8,
    not valid JSON or not an object comes back as a record with ``data=None`` and ``error`` set
    (the rest of the file is kept), so the caller's bad-data policy decides. A JSON array file
    that does not parse raises ``ValueError`` naming the line (nothing in it is recoverable). A
    UTF-8 byte-order mark is ignored.

    Args:
        path_or_paths: a file, a folder (all its ``.json``/``.jsonl`` files, sorted), or a
            list of those; records keep the order of the files and of their entries.
        index_dir: where the indexes are kept (default: see `ray_dhp.data.index.index_dir_for`).

    Returns:
        Records with ``index`` = position in the returned sequence.
    """
    return Annotations([index_file(p, index_dir) for p in _expand(path_or_paths)])


def resolve_data_root(path, data_root=None) -> Path:
    """Folder that relative image paths are resolved against.

    Args:
        path: the annotation file (or the first of a list of them).
        data_root: explicit root; when ``None``, the folder of the annotation file.
    """
    if data_root is not None:
        return Path(data_root).expanduser().resolve()
    if not isinstance(path, (str, Path)):
        path = list(path)[0]
    p = Path(path).expanduser().resolve()
    return p if p.is_dir() else p.parent
