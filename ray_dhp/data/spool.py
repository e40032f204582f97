"""Ray Datasets streamed into a node-local spool: constant memory, the same order on every rank.

A Ray Dataset given as ``datasets={"train": ds}`` reaches every worker whole (the trainer does not
split it: every rank runs the same sampler over the same records). Instead of materialising it,
one worker per node has it streamed (``iter_batches``, so Ray Data's streaming execution and any
``map_batches`` preprocessing run as usual; in a short-lived Ray task on the node, so the
stream's object-store blocks are never mapped into the worker) into a JSON-lines file on local
disk, with the record index (`ray_dhp.data.index`) written as it goes; the node's other
workers wait on the spool's lock and then map the same files. From there a Ray Dataset is an annotation file like any other:
every rank agrees on each step's composition from the seed alone, records are parsed on demand
by the rank that decodes them, and the sampler's checkpointed position resumes exactly.

What is guaranteed: the spool is keyed by the run (its ``RunConfig`` name and storage folder,
`ray_dhp.data.sources.run_key`), so a restart after a failure — or a later ``fit`` of the same run name —
reuses it: the same rows, the same order, an exact resume, no second pass over the stream. A
new run (``resume_from`` another run's checkpoint, or a spool folder that is gone) streams the
dataset again: that resume is exact when the dataset yields the same rows in the same order
(deterministic sources and transforms; the trainer sets ``preserve_order=True``; a
``random_shuffle`` needs its ``seed``). With several nodes, each node streams its own spool: they agree under that same condition, which every rank checks by the
spool's row count and content digest (`check_agreement`).

Clean-up: when a run ends successfully (`release_spools`, after its last step on every rank)
its spools are deleted, on every node; a later ``fit`` of the same run streams the dataset again.
When it fails they are kept, since the run is resumable: Ray Train's restart and a later ``fit``
of the same run read them back (that is what makes the resume exact for a non-deterministic
dataset). A write cut short — a killed worker leaves a ``.tmp<pid>`` file, never an index — is
removed when the next spool of any run starts in that folder (`sweep_partial`: no process holds
its spool's lock any longer, so nobody is writing it).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
from pathlib import Path

import numpy as np

from ray_dhp.data.index import FileIndex, IndexWriter, _header, locked

__all__ = ["spool_dataset", "spool_dir", "check_agreement", "release_spools", "sweep_partial"]

_BATCH = 1024


def spool_dir(index_dir=None) -> Path:
    """Folder of the spools: ``index_dir``, else ``<tmp>/ray_dhp_spool`` (node-local)."""
    return Path(index_dir).expanduser() if index_dir else Path(tempfile.gettempdir()) / "ray_dhp_spool"


def _jsonable(value):
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"a Ray Dataset value of type {type(value).__name__} cannot be a LLaVA record "
                    "field (records hold text, numbers, lists and image paths)")


def _row_line(row: dict) -> bytes:
    """One row as a JSON line; None values (Ray Data fills absent keys with None, e.g. ``image``
    of a text-only sample) are dropped."""
    return json.dumps({k: v for k, v in row.items() if v is not None}, default=_jsonable).encode()


def spool_dataset(iterator, name: str, directory: Path, key: str, *, in_task: bool = False) -> FileIndex:
    """The `FileIndex` of Ray Dataset ``name`` (its ``DataIterator``, e.g.
    ``ray.train.get_dataset_shard(name)``), spooled once per ``key`` into ``directory``.
    ``in_task``: stream it in a short-lived Ray task on this node (`write_in_task`), so this
    process never maps the stream's blocks; else here."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{name}.{key}")
    data_path = Path(directory) / f"{safe}.jsonl"
    index_path = data_path.with_name(data_path.name + ".idx")
    sweep_partial(Path(directory))
    with locked(index_path):
        head = _header(index_path)
        if head is None or not data_path.exists():
            (write_in_task if in_task else _write)(iterator, data_path, index_path)
            head = _header(index_path)
    index = FileIndex(f"ray.data:{name}", index_path, data_path, "item", head[1])
    index.fingerprint = (head[1], head[3])  # (rows, content digest)
    return index


def _write(iterator, data_path: Path, index_path: Path) -> None:
    tmp = data_path.with_name(data_path.name + f".tmp{os.getpid()}")
    try:
        _stream(iterator, tmp, data_path, index_path)
    except BaseException:  # a failed write leaves nothing behind (no index: no spool)
        tmp.unlink(missing_ok=True)
        raise


def _stream(iterator, tmp: Path, data_path: Path, index_path: Path) -> None:
    digest, pos, rows = hashlib.blake2b(digest_size=16), 0, 0
    with IndexWriter(index_path, kind=1, key=(0, 0)) as writer, open(tmp, "wb") as out:
        for batch in iterator.iter_batches(batch_size=_BATCH, batch_format="pyarrow"):
            lines = [_row_line(r) for r in batch.to_pylist()]
            lengths = np.fromiter((len(x) for x in lines), dtype=np.int64, count=len(lines))
            starts = pos + np.concatenate(([0], np.cumsum(lengths + 1)[:-1]))
            blob = b"\n".join(lines) + b"\n" if lines else b""
            out.write(blob)
            digest.update(blob)
            writer.add(starts, lengths, np.arange(rows, rows + len(lines)))
            pos, rows = pos + len(blob), rows + len(lines)
        out.flush()
        os.fsync(out.fileno())
        os.replace(tmp, data_path)  # before the index: an index means a complete spool
        writer.key = (rows, int.from_bytes(digest.digest()[:8], "little", signed=True))


def write_in_task(iterator, data_path: Path, index_path: Path) -> None:
    """`_write` in a Ray task pinned to this node (its local disk), 0 CPUs (the workers hold the
    run's): the stream's blocks are mapped there, and released when it ends, not in the worker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    task = ray.remote(_write).options(num_cpus=0, scheduling_strategy=here, max_retries=0)
    ray.get(task.remote(iterator, data_path, index_path))


def _fingerprints(sampler) -> dict:
    """``{source: (rows, digest)}`` of the spooled Ray Datasets among ``sampler.records``."""
    out = {}
    for part in getattr(sampler.records, "parts", ()):
        for f in getattr(part, "files", ()):
            if getattr(f, "fingerprint", None) is not None:
                out[f.source] = f.fingerprint
    return out


def check_agreement(sampler, group=None) -> None:
    """Raise unless every rank spooled the same rows of each of the sampler's Ray Datasets: the
    datasets must be deterministic for the ranks to agree on the steps. Collective (every rank
    of ``group``, a gloo group: ``all_gather_object``); nothing to do without Ray Datasets."""
    import torch.distributed as dist

    mine = _fingerprints(sampler)
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, mine, group=group)
    for rank, theirs in enumerate(parts):
        if theirs != mine:
            raise ValueError(
                f"the Ray Datasets {sorted(mine)} streamed differently on two nodes (rank {rank}: "
                f"{theirs}, here: {mine} as (rows, digest)): every rank must see the same rows in "
                "the same order; make the dataset deterministic (fixed inputs, a seeded "
                "random_shuffle, preserve_order=True)")


def sweep_partial(directory: Path) -> list:
    """Delete the partial writes in ``directory`` that nobody is writing any more: a
    ``<spool>.jsonl.tmp<pid>`` whose spool lock (held by the writer for the whole write) is free.
    Returns the deleted paths."""
    out = []
    for tmp in sorted(Path(directory).glob("*.jsonl.tmp*")):
        lock = tmp.with_name(tmp.name.rsplit(".tmp", 1)[0] + ".idx.lock")
        with open(lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # being written now
                continue
            try:
                tmp.unlink(missing_ok=True)
                out.append(tmp)
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
    return out


def release_spools(sampler, group=None) -> list:
    """At the successful end of a run: delete the spools of the sampler's Ray Datasets (data,
    index and lock files) once every rank of ``group`` is done with them (a barrier; ranks of
    one node delete the same files, so a missing one is fine; a rank that still has them mapped
    keeps its mapping). Collective when ``group`` has several ranks; returns the deleted paths."""
    import torch.distributed as dist

    files = [f for part in getattr(sampler.records, "parts", ()) for f in getattr(part, "files", ())
             if getattr(f, "fingerprint", None) is not None]
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.barrier(group=group)
    out = []
    for f in files:
        for path in (f.data_path, f.index_path, Path(str(f.index_path) + ".lock")):
            if path.exists():
                path.unlink(missing_ok=True)
                out.append(path)
    return out
