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


def _array_error(path: Path, exc: json.JSONDecodeError) -> ValueError:
    return ValueError(f"{path}:{exc.lineno}: not a valid JSON array ({exc.msg}, column {exc.colno}); "
                      "a .json file holds one array of records, use .jsonl for one record per line")


def _read_json_array(path: Path, raw: bytes) -> Iterable[tuple[int, dict | None, str | None]]:
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        line = raw.count(b"\n", 0, exc.start) + 1
        raise ValueError(f"{path}:{line}: not UTF-8 (byte {raw[exc.start]:#04x}); a JSON array file "
                         "must be UTF-8 throughout (a .jsonl file loses only its bad lines)") from exc
    try:
        items = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _array_error(path, exc) from exc
    if not isinstance(items, list):
        raise ValueError(f"{path}: expected a JSON array of records, got {type(items).__name__}")
    for i, item in enumerate(items):
        if isinstance(item, dict):
            yield i, item, None
        else:
            yield i, None, f"not an object: item is a {type(item).__name__}, not a JSON object"


def _parse_line(line: str) -> tuple[dict | None, str | None]:
    try:
        item = json.loads(line)
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} (column {exc.colno})"
    except RecursionError:
        return None, "malformed JSON: nested too deeply"
    if isinstance(item, dict):
        return item, None
    return None, f"not an object: line is a {type(item).__name__}, not a JSON object"


def _read_json_lines(raw: bytes) -> Iterable[tuple[int, dict | None, str | None]]:
    """One record per ``\\n``-terminated line (only ``\\n`` ends a line: U+2028, U+0085, form
    feeds... inside a record are text). Lines are decoded one by one, so a line with bytes that
    are not UTF-8 is one bad record and the others are kept."""
    if raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte-order mark
        raw = raw[3:]
    try:
        lines = raw.decode("utf-8").split("\n")  # the common case: one decode for the file
    except UnicodeDecodeError:
        lines = raw.split(b"\n")
    for number, line in enumerate(lines, start=1):
        if isinstance(line, bytes):
            try:
                line = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield number, None, (f"not UTF-8: byte {line[exc.start]:#04x} at column "
                                     f"{exc.start + 1}")
                continue
        if not line.strip():
            continue
        data, error = _parse_line(line)
        yield number, data, error


def _is_array(path: Path, raw: bytes) -> bool:
    """``.jsonl``: lines; ``.json``: an array (unless its content does not start with ``[``,
    as LLaVA-style ``.json`` files of JSON lines do); other names: by content."""
    if path.suffix == ".jsonl":
        return False
    return raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def read_annotations(path_or_paths) -> list[Record]:
    """Read LLaVA-format annotations from JSON (one array) and/or JSONL (one object per line) files.

    The format comes from the file name: ``.jsonl`` is JSON lines, ``.json`` a JSON array (read
    as JSON lines when its content does not start with ``[``); other names are told apart by
    their content. JSON lines are split at ``\\n`` only (blank lines skipped) and decoded one
    by one: a line that is not UTF-8, not valid JSON or not an object comes back as a record
    with ``data=None`` and ``error`` set (the rest of the file is kept), so the caller's
    bad-data policy decides. A JSON array file that does not parse raises ``ValueError``
    naming the line (nothing in it is recoverable). A UTF-8 byte-order mark is ignored.

    Args:
        path_or_paths: a file, a folder (all its ``.json``/``.jsonl`` files, sorted), or a
            list of those; records keep the order of the files and of their entries.

    Returns:
        Records with ``index`` = position in the returned list.
    """
    records: list[Record] = []
    for path in _expand(path_or_paths):
        raw = path.read_bytes()
        is_array = _is_array(path, raw)
        entries = _read_json_array(path, raw) if is_array else _read_json_lines(raw)
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
