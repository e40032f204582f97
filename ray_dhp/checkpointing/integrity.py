"""Which checkpoint directories can be trusted: file records, content hashes, durable writes.

A checkpoint's metadata JSON lists every file of the checkpoint with its size and SHA-256
(``"files": {relative path: {"size": n, "sha256": hex}}``), and its ``COMMIT`` file holds the
step and the SHA-256 of the metadata JSON itself. Two levels of checking:

* `is_complete` — cheap, run on every directory a scan looks at: ``COMMIT`` present, the
  metadata JSON parses and matches the hash in ``COMMIT``, every listed file is present with
  its recorded size. It reads no pickle (DCP's ``.metadata`` is a pickle; it is only read by the
  load itself, see docs/reliability.md).
* `verify` — the content hashes, run only on the checkpoint about to be loaded (split over the
  ranks by `ray_dhp.checkpointing.checkpoint.load`): a flipped bit makes the checkpoint count as corrupt, and
  the load falls back to the previous complete one.

Checkpoints written before the file list existed (no ``"files"`` key) keep the older check:
every file DCP's metadata names is present with at least its recorded size (this reads the
pickled ``.metadata``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

logger = logging.getLogger(__name__)

META_FILE = "ray_dhp_checkpoint.json"
COMMIT_FILE = "COMMIT"
_CHUNK = 8 << 20


def sha256_file(path: str) -> str:
    """Hex SHA-256 of a file, read in 8 MiB chunks (constant memory; hashlib drops the GIL)."""
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def file_records(directory: str, names) -> dict:
    """``{name: {"size", "sha256"}}`` of the files ``names`` (relative to ``directory``)."""
    out = {}
    for name in sorted(names):
        p = os.path.join(directory, name)
        out[name] = {"size": os.path.getsize(p), "sha256": sha256_file(p)}
    return out


def tree_files(directory: str, sub: str) -> list:
    """Relative paths of the regular files under ``directory/sub`` (none if it is absent)."""
    root = os.path.join(directory, sub)
    out = []
    for base, _, files in os.walk(root):
        out += [os.path.relpath(os.path.join(base, f), directory) for f in files]
    return out


def write_atomic(path: str, data) -> None:
    """Write ``data`` (str or bytes) to ``path`` durably: a temporary file in the same folder,
    fsync, then ``os.replace`` — a reader sees the old content or the new, never a torn file."""
    raw = data.encode() if isinstance(data, str) else data
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(raw)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def commit(directory: str, meta: dict) -> None:
    """Write the metadata JSON, then ``COMMIT`` (step and the metadata's hash), each atomically."""
    raw = json.dumps(meta, indent=1).encode()
    write_atomic(os.path.join(directory, META_FILE), raw)
    write_atomic(os.path.join(directory, COMMIT_FILE),
                 f"{meta['step']}\n{hashlib.sha256(raw).hexdigest()}\n")


def read_meta(directory: str) -> dict:
    """The metadata JSON of a checkpoint (plain JSON, no pickle)."""
    with open(os.path.join(directory, META_FILE)) as f:
        meta = json.load(f)
    if not isinstance(meta, dict):
        raise ValueError(f"{directory}/{META_FILE} is not a JSON object")
    return meta


def _meta_if_committed(d: str):
    """The metadata when ``COMMIT`` and the metadata exist, parse, and agree; else None."""
    try:
        with open(os.path.join(d, COMMIT_FILE)) as f:
            lines = f.read().split()
        with open(os.path.join(d, META_FILE), "rb") as f:
            raw = f.read()
        meta = json.loads(raw)
    except (OSError, ValueError) as e:  # missing, or torn / corrupt JSON
        logger.debug("%s: not committed (%s)", d, e)
        return None
    if len(lines) > 1 and lines[1] != hashlib.sha256(raw).hexdigest():
        logger.warning("%s: metadata does not match the hash in COMMIT (corrupt)", d)
        return None
    if not isinstance(meta, dict) or "step" not in meta:
        return None
    return meta


def is_complete(directory: str) -> bool:
    """True if ``directory`` holds a whole checkpoint: ``COMMIT``, a metadata JSON that matches
    it, and every file it lists at its recorded size (no content hashing: see `verify`)."""
    d = os.fspath(directory)
    meta = _meta_if_committed(d)
    if meta is None:
        return False
    files = meta.get("files")
    if files is None:
        return _legacy_complete(d)
    for name, rec in files.items():
        p = os.path.join(d, name)
        if not os.path.isfile(p) or os.path.getsize(p) != rec.get("size"):
            return False
    return True


def _legacy_complete(d: str) -> bool:
    """Checkpoints without a file list: the shards DCP's (pickled) metadata names."""
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(d, ".metadata")):
        return False
    try:
        storage = dcp.FileSystemReader(d).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - a truncated .metadata is an incomplete checkpoint
        logger.warning("unreadable DCP metadata in %s: %s", d, e)
        return False
    need: dict = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    return all(os.path.isfile(os.path.join(d, n)) and os.path.getsize(os.path.join(d, n)) >= size
               for n, size in need.items())


def verify(directory: str, part: tuple = (0, 1)) -> list:
    """Files of the checkpoint whose content hash differs from the recorded one (``[]``: intact).

    Args:
        part: ``(k, n)``: check only every n-th file from the k-th (sorted by name), so that n
            ranks share the work.
    """
    meta = read_meta(directory)
    files = sorted((meta.get("files") or {}).items())
    k, n = part
    return [name for name, rec in files[k::n]
            if sha256_file(os.path.join(directory, name)) != rec.get("sha256")]


def step_of(directory: str) -> int:
    try:
        return int(read_meta(directory)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        m = re.search(r"(\d+)$", os.path.basename(os.path.normpath(directory)))
        return int(m.group(1)) if m else -1


def _complete_children(folder: str) -> list:
    subs = [os.path.join(folder, s) for s in os.listdir(folder)]
    return [s for s in subs if os.path.isdir(s) and is_complete(s)]


def _looks_like_checkpoint(directory: str) -> bool:
    """Holds checkpoint files (complete or not), as opposed to a folder of checkpoints."""
    return any(n in (".metadata", META_FILE, COMMIT_FILE) or n.endswith(".distcp")
               for n in os.listdir(directory))


def candidates(path: str) -> list:
    """Complete checkpoints to try for ``path``, preferred first (cheap checks only).

    A checkpoint: itself if complete, then its complete siblings with a lower step, newest first
    (never a newer one). A folder of checkpoints: its complete children, newest first.
    Raises FileNotFoundError if there is none.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if not _looks_like_checkpoint(path):
        children = sorted(_complete_children(path), key=step_of, reverse=True)
        if not children:
            raise FileNotFoundError(f"no complete checkpoint in {path}")
        return children
    step, complete = step_of(path), is_complete(path)
    older = [c for c in _complete_children(os.path.dirname(path))
             if c != path and (step_of(c) < step or step < 0)]
    older.sort(key=step_of, reverse=True)
    if not complete and not older:
        raise FileNotFoundError(f"checkpoint {path} is incomplete (torn write) and no complete "
                                f"earlier checkpoint was found next to it")
    if not complete:
        logger.warning("checkpoint %s is incomplete; falling back to %s", path, older[0])
    return ([path] if complete else []) + older
