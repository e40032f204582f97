"""A compact, memory-mapped index of an annotation file: where each record's bytes are.

Instead of parsing every record into a Python object (hundreds of bytes each, in every worker),
a file is scanned once for its line breaks (numpy over 64 MiB chunks) and the result is kept as
one fixed-size entry per record — byte offset, length and line number, 16 bytes — in an index
file read back memory-mapped. A record is parsed only when someone asks for it (the rank that
decodes it). A JSON array file is converted once into JSON lines (one item a line) kept beside
its index, and indexed the same way.

Index files live in ``index_dir`` (default: a ``.ray_dhp_index`` folder beside the data, or
``~/.cache/ray_dhp/index`` where the data folder is not writable). An index names the file's
size and modification time: a changed file is indexed again. Building takes an exclusive lock on
the index, so the workers of a node build it once and the others wait and read it; it is written
to a temporary name and renamed (a crash never leaves half an index).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import struct
from pathlib import Path

import numpy as np

__all__ = ["ENTRY", "FileIndex", "index_file", "index_dir_for"]

#: one record: byte offset in the data file, byte length (without the newline), line number
#: (1-based line of a JSON-lines file; 0-based item of a JSON array or a Ray Dataset row)
ENTRY = np.dtype([("start", "<i8"), ("length", "<u4"), ("line", "<u4")])
_MAGIC, _VERSION = b"RDHPIDX1", 1
_HEADER = struct.Struct("<8sIIqqq")  # magic, version, kind, count, size, mtime_ns
_HEADER_BYTES = 64
_KINDS = {0: "line", 1: "item"}
_CHUNK = 64 << 20
_BOM = b"\xef\xbb\xbf"
# a line whose first byte is one of these may be blank (str.strip() removes it): checked exactly
_MAYBE_SPACE = np.zeros(256, dtype=bool)
_MAYBE_SPACE[[9, 10, 11, 12, 13, 28, 29, 30, 31, 32]] = True
_MAYBE_SPACE[0x80:] = True  # U+0085, U+00A0, U+2028, U+3000...: multi-byte whitespace


class FileIndex:
    """The records of one annotation file through its index (opened lazily; pickles by path).

    Attributes:
        source: the annotation file as records name it (``where``).
        data_path: the file whose bytes the entries point into (the source itself, or its
            converted JSON lines for a JSON array).
        line_kind: ``"line"`` or ``"item"``.
    """

    def __init__(self, source: str, index_path: Path, data_path: Path, line_kind: str, count: int):
        self.source, self.index_path, self.data_path = source, Path(index_path), Path(data_path)
        self.line_kind, self._count = line_kind, count
        self._entries = self._fd = None

    def __len__(self) -> int:
        return self._count

    @property
    def entries(self) -> np.ndarray:
        """The ``ENTRY`` array, memory-mapped (pages are read when touched)."""
        if self._entries is None:
            self._entries = np.memmap(self.index_path, dtype=ENTRY, mode="r",
                                      offset=_HEADER_BYTES, shape=(self._count,))
        return self._entries

    def raw(self, i: int) -> tuple[bytes, int]:
        """``(bytes of record i, its line number)``."""
        if self._fd is None:
            self._fd = os.open(self.data_path, os.O_RDONLY)
        e = self.entries[i]
        return os.pread(self._fd, int(e["length"]), int(e["start"])), int(e["line"])

    def __getstate__(self):
        return {**self.__dict__, "_entries": None, "_fd": None}

    def __del__(self):
        if getattr(self, "_fd", None) is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)


def index_dir_for(path: Path, index_dir=None) -> Path:
    """Where the index of ``path`` goes: ``index_dir``, else ``.ray_dhp_index`` beside the data
    when that folder is writable, else ``~/.cache/ray_dhp/index``."""
    if index_dir is not None:
        return Path(index_dir).expanduser()
    if os.access(path.parent, os.W_OK):
        return path.parent / ".ray_dhp_index"
    return Path.home() / ".cache" / "ray_dhp" / "index"


def _names(path: Path, index_dir: Path) -> tuple[Path, Path]:
    tag = hashlib.sha256(str(path).encode()).hexdigest()[:12]
    base = index_dir / f"{path.name}.{tag}"
    return base.with_name(base.name + ".idx"), base.with_name(base.name + ".items.jsonl")


def _header(index_path: Path):
    try:
        with open(index_path, "rb") as f:
            magic, version, kind, count, size, mtime = _HEADER.unpack(f.read(_HEADER.size))
    except (OSError, struct.error):
        return None
    return (kind, count, size, mtime) if (magic, version) == (_MAGIC, _VERSION) else None


@contextlib.contextmanager
def locked(path: Path):
    """An exclusive lock on ``path.lock`` (held by one process of the machine at a time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(str(path) + ".lock", "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def index_file(path, index_dir=None) -> FileIndex:
    """The `FileIndex` of annotation file ``path``: read back when an index of this very file
    (same size and modification time) exists, else built (and kept) first."""
    path = Path(path).resolve()
    st = path.stat()
    index_path, items_path = _names(path, index_dir_for(path, index_dir))
    with locked(index_path):
        head = _header(index_path)
        if head is None or head[2:] != (st.st_size, st.st_mtime_ns):
            kind = 1 if is_array_file(path) else 0
            if kind == 1:
                _convert_array(path, items_path)  # items: line k of the converted file is item k
            with IndexWriter(index_path, kind, (st.st_size, st.st_mtime_ns)) as writer:
                writer.add(*_scan(items_path if kind == 1 else path, first_line=1 - kind))
            head = _header(index_path)
    kind, count = head[0], head[1]
    return FileIndex(str(path), index_path, items_path if kind == 1 else path, _KINDS[kind], count)


class IndexWriter:
    """Writes an index file: entries appended in batches, the header (with the count) last,
    then renamed into place."""

    def __init__(self, index_path: Path, kind: int, key: tuple):
        self.path, self.kind, self.key = Path(index_path), kind, key
        self.tmp = self.path.with_name(self.path.name + f".tmp{os.getpid()}")
        self.count, self._f = 0, None

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.tmp, "wb")
        self._f.write(b"\0" * _HEADER_BYTES)
        return self

    def add(self, starts, lengths, lines) -> None:
        """Append entries (``starts``/``lengths``/``lines``: arrays of one length, or iterators
        of such triples' arrays when a scan yields them chunk by chunk)."""
        for s, n, l in _batches(starts, lengths, lines):
            if len(n) and int(np.max(n)) >= 2 ** 32:
                raise ValueError(f"a record of {int(np.max(n))} bytes: at most 4 GiB per record")
            e = np.empty(len(s), dtype=ENTRY)
            e["start"], e["length"], e["line"] = s, n, l
            self._f.write(e.tobytes())
            self.count += len(s)

    def __exit__(self, exc_type, exc, tb):
        try:
            if exc_type is None:
                self._f.seek(0)
                self._f.write(_HEADER.pack(_MAGIC, _VERSION, self.kind, self.count, *self.key))
                self._f.flush()
                os.fsync(self._f.fileno())
        finally:
            self._f.close()
        if exc_type is None:
            os.replace(self.tmp, self.path)
        else:
            with contextlib.suppress(OSError):
                os.unlink(self.tmp)


def _batches(starts, lengths, lines):
    if isinstance(starts, np.ndarray):
        yield starts, lengths, lines
    else:  # one generator of (starts, lengths, lines) per chunk
        yield from starts


def _scan(path: Path, first_line: int):
    """``(generator of per-chunk (starts, lengths, lines), None, None)`` for `IndexWriter.add`:
    the lines of ``path`` split at ``\\n`` only, blank ones (nothing but whitespace, as
    ``str.strip`` sees it) left out; a leading UTF-8 byte-order mark is skipped."""
    return _scan_chunks(path, first_line), None, None


def _scan_chunks(path: Path, first_line: int):
    size = path.stat().st_size
    buf = bytearray(max(1, min(_CHUNK, size)))
    with open(path, "rb") as f:
        fd = f.fileno()
        base, line_no = 0, first_line  # line_no: number of the line starting at `carry`
        carry = 3 if os.pread(fd, 3, 0) == _BOM else 0
        while base < size:
            n = f.readinto(buf)
            arr = np.frombuffer(buf, dtype=np.uint8, count=n)
            nl = np.flatnonzero(arr == 10).astype(np.int64)
            nl += base
            base += n
            ends = nl if base < size else np.append(nl, size)  # the last line needs no "\n"
            if not len(ends):
                continue
            starts = np.empty(len(ends), dtype=np.int64)
            starts[0], starts[1:] = carry, nl[:len(ends) - 1] + 1
            lines = np.arange(line_no, line_no + len(ends), dtype=np.int64)
            carry, line_no = (int(nl[-1]) + 1 if len(nl) else carry), line_no + len(nl)
            keep = _not_blank(fd, arr, base - n, starts, ends)
            yield starts[keep], (ends - starts)[keep], lines[keep]


def _not_blank(fd: int, arr: np.ndarray, base: int, starts: np.ndarray, ends: np.ndarray):
    """Mask of the lines that are not blank: empty lines are; a line whose first byte may be
    whitespace is decoded and stripped (one that is not UTF-8 is kept: it is a bad record)."""
    lengths = ends - starts
    keep = lengths > 0
    inside = (starts >= base) & keep
    first = np.zeros(len(starts), dtype=np.uint8)
    first[inside] = arr[starts[inside] - base]
    suspect = np.flatnonzero(keep & (~inside | _MAYBE_SPACE[first]))
    for k in suspect:
        raw = os.pread(fd, int(lengths[k]), int(starts[k]))
        try:
            keep[k] = bool(raw.decode("utf-8").strip())
        except UnicodeDecodeError:
            pass
    return keep


def _convert_array(path: Path, items_path: Path) -> None:
    """Write the items of JSON array file ``path`` as JSON lines (ASCII: every item
    round-trips); raises ``ValueError`` naming the line when the file is not a JSON array."""
    items = parse_json_array(path, path.read_bytes())
    tmp = items_path.with_name(items_path.name + f".tmp{os.getpid()}")
    with open(tmp, "w", encoding="ascii") as f:
        for item in items:
            f.write(json.dumps(item))
            f.write("\n")
    os.replace(tmp, items_path)


def _array_error(path: Path, exc: json.JSONDecodeError) -> ValueError:
    return ValueError(f"{path}:{exc.lineno}: not a valid JSON array ({exc.msg}, column {exc.colno}); "
                      "a .json file holds one array of records, use .jsonl for one record per line")


def parse_json_array(path: Path, raw: bytes) -> list:
    """The items of JSON array file ``path`` (content ``raw``); ``ValueError`` naming the line
    when it is not UTF-8 or not one JSON array (nothing in such a file is recoverable)."""
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
    return items


_SPACE = b"\xef\xbb\xbf \t\r\n"


def is_array_file(path: Path) -> bool:
    """``.jsonl``: lines; ``.json``: an array (unless its content does not start with ``[``,
    as LLaVA-style ``.json`` files of JSON lines do); other names: by content."""
    if path.suffix == ".jsonl":
        return False
    with open(path, "rb") as f:
        while True:
            head = f.read(1 << 16)
            if not head:
                return False
            head = head.lstrip(_SPACE)
            if head:
                return head.startswith(b"[")
