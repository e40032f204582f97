"""Reading LLaVA-format annotation files (a JSON array or JSON lines) into records.

Reading never drops anything silently: a JSONL line that is not valid JSON (or not an object)
becomes a :class:`Record` flagged bad, with its file, line and reason, and the bad-data policy
of the caller decides whether to skip it or stop.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Record", "read_annotations", "resolve_data_root"]

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


def _read_json_array(path: Path, text: str) -> Iterable[tuple[int, dict | None, str | None]]:
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path}: not a valid JSON array ({exc}); a JSON file must hold one array "
                         "of records, use .jsonl for one record per line") from exc
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON array of records, got {type(items).__name__}")
    for i, item in enumerate(items):
        if isinstance(item, dict):
            yield i, item, None
        else:
            yield i, None, f"item is a {type(item).__name__}, not a JSON object"


def _read_json_lines(text: str) -> Iterable[tuple[int, dict | None, str | None]]:
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError as exc:
            yield number, None, f"malformed JSON: {exc.msg} (column {exc.colno})"
            continue
        if isinstance(item, dict):
            yield number, item, None
        else:
            yield number, None, f"line is a {type(item).__name__}, not a JSON object"


def read_annotations(path_or_paths) -> list[Record]:
    """Read LLaVA-format annotations from JSON (one array) and/or JSONL (one object per line) files.

    A file whose content starts with ``[`` is read as a JSON array, any other as JSON lines
    (blank lines skipped). Malformed JSONL lines do not abort the read: they come back as
    records with ``data=None`` and ``error`` set, so the caller's bad-data policy decides.
    A JSON array file that does not parse raises ``ValueError`` (nothing in it is recoverable).

    Args:
        path_or_paths: a file, a folder (all its ``.json``/``.jsonl`` files, sorted), or a
            list of those; records keep the order of the files and of their entries.

    Returns:
        Records with ``index`` = position in the returned list.
    """
    records: list[Record] = []
    for path in _expand(path_or_paths):
        text = path.read_text(encoding="utf-8")
        is_array = text.lstrip().startswith("[")
        entries = _read_json_array(path, text) if is_array else _read_json_lines(text)
        kind = "item" if is_array else "line"
        for line, data, error in entries:
            records.append(Record(len(records), data, str(path), line, error, line_kind=kind))
    return records


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


def records_from_rows(rows, source: str = "ray.data") -> list[Record]:
    """Records from already-parsed rows (e.g. a Ray Dataset's ``iter_rows()``), in order.

    Rows are LLaVA dicts; Ray Data may add columns of None for keys other rows have (an absent
    ``image`` of a text-only sample reads as None): those None values are dropped.
    """
    out = []
    for i, row in enumerate(rows):
        data = {k: v for k, v in dict(row).items() if v is not None}
        out.append(Record(i, data, source, i, line_kind="item"))
    return out
