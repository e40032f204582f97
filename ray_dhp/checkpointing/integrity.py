"""Which checkpoint directories can be trusted: file records, content hashes, durable writes.

A checkpoint's metadata JSON lists every file of the checkpoint with its size and checksums
(``"files": {relative path: {"size": n, "xxh3_128": hex}}``; a DCP shard file has ``"chunks":
[[offset, length, hex], ...]`` instead: one XXH3-128 per stored item, computed while DCP wrote
it, `ray_dhp.checkpointing.hashing`), and its ``COMMIT`` file holds the step and the SHA-256 of
the metadata JSON itself. Three levels of checking:

* `is_complete` — cheap, run on every directory a scan looks at: ``COMMIT`` present, the
  metadata JSON parses and matches the hash in ``COMMIT``, every listed file is present with
  its recorded size. It reads no pickle (DCP's ``.metadata`` is a pickle; it is only read by the
  load itself, see docs/reliability.md).
* `verify_small` — the whole-file checksums of the small files (DCP's ``.metadata``, RNG
  states, the processor), run before loading; the shards' item checksums are checked by the
  load itself as it reads each item (`ray_dhp.checkpointing.hashing.VerifyingReader`): a
  flipped bit makes the checkpoint count as corrupt, and the load falls back to the previous
  complete one.
* `verify` — every checksum, shards included, in one sequential read (for `resolve` in one
  process: export, tools).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re

from ray_dhp.checkpointing.hashing import DIGEST, digest_file, verify_chunks

logger = logging.getLogger(__name__)

META_FILE = "ray_dhp_checkpoint.json"
COMMIT_FILE = "COMMIT"


def file_records(directory: str, names, chunks: dict = None) -> dict:
    """``{name: {"size", DIGEST}}`` of the files ``names`` (relative to ``directory``); a name
    in ``chunks`` (the shard files, ``{name: [[offset, length, digest], ...]}`` recorded while
    writing) gets ``{"size", "chunks"}`` and is not read again."""
    chunks = chunks or {}
    out = {}
    for name in sorted(names):
        p = os.path.join(directory, name)
        if name in chunks:
            out[name] = {"size": os.path.getsize(p), "chunks": sorted(chunks[name])}
        else:
            out[name] = {"size": os.path.getsize(p), DIGEST: digest_file(p)}
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
    if not isinstance(files, dict):
        return False
    for name, rec in files.items():
        p = os.path.join(d, name)
        if not os.path.isfile(p) or os.path.getsize(p) != rec.get("size"):
            return False
    return True


def _intact(directory: str, name: str, rec: dict) -> bool:
    p = os.path.join(directory, name)
    if "chunks" in rec:
        return verify_chunks(p, rec["chunks"])
    return digest_file(p) == rec.get(DIGEST)


def verify(directory: str, part: tuple = (0, 1), shards: bool = True) -> list:
    """Files of the checkpoint whose checksums differ from the recorded ones (``[]``: intact).

    Args:
        part: ``(k, n)``: check only every n-th file from the k-th (sorted by name), so that n
            ranks share the work.
        shards: also the DCP shard files (False: only the small whole-file records; the load
            checks the shards' items as it reads them).
    """
    meta = read_meta(directory)
    files = sorted((meta.get("files") or {}).items())
    if not shards:
        files = [(n, r) for n, r in files if "chunks" not in r]
    k, n = part
    return [name for name, rec in files[k::n] if not _intact(directory, name, rec)]


def shard_chunks(meta: dict) -> dict:
    """``{shard file: [[offset, length, digest], ...]}`` of a checkpoint's metadata."""
    return {n: r["chunks"] for n, r in (meta.get("files") or {}).items() if "chunks" in r}


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
