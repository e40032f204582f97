"""Sharded checkpoints of the DHP engine that load at any layout (torch.distributed.checkpoint).

What one checkpoint directory holds (every rank writes into its own temporary directory; Ray
Train merges them into one storage directory, so every file name is unique per rank):

* ``__<rank>_0.distcp`` + ``.metadata`` — one DCP checkpoint over all ranks with
  ``model.<name>`` (parameters by the model's own Hugging Face names; text parameters are
  DTensors under tensor parallelism, saved as shards), ``optim.<module>`` (AdamW state
  keyed by parameter name, `get_optimizer_state_dict`) and ``sched.<module>`` (vision, audio, ..., text). Replicated
  tensors (vision parameters on every vision rank, text parameters on every text replica) are
  stored once (DCP deduplicates identical keys). Loading into another layout's (DTensor) state
  dict reshards.
* ``rng_rank<r>.pt`` — each rank's RNG states, tensors and plain tuples only (read back with
  ``torch.load(weights_only=True)``: no code runs); restored only at the same layout.
* ``ray_dhp_checkpoint.json`` (rank 0) — format version, step, family, the layout it was
  written with, sampler position, the transformers config (compared with the model being
  trained on load, and used by `ray_dhp.export_hf`) and every file's size and checksums:
  XXH3-128 of each stored item of a shard file, computed as DCP wrote it, or of a whole small
  file (`ray_dhp.checkpointing.hashing`).
* ``COMMIT`` (rank 0, written last, after a barrier that follows every rank's shard write): the
  step and the SHA-256 of the metadata JSON.

A checkpoint counts as complete only if ``COMMIT`` and the metadata agree and every listed file
is present at its size: Ray copies each rank's directory separately, so a crash can leave a
directory with some ranks' files only. The load checks each shard item's checksum as it reads
it (nothing is read twice), the small files' before; a torn or corrupt checkpoint falls back,
on every rank alike, to the newest complete, intact one before it
(`ray_dhp.checkpointing.integrity`). `save` writes synchronously; `ray_dhp.checkpointing.staging`
stages a snapshot in host memory and writes it in the background. DCP's ``.metadata`` is a pickle: load checkpoints only from
storage you trust (docs/reliability.md).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import random
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from ray_dhp.checkpointing import integrity
from ray_dhp.checkpointing.compat import FORMAT_VERSION, check_compatible, check_same_model
from ray_dhp.checkpointing.hashing import CorruptChunk, HashingWriter, VerifyingReader
from ray_dhp.checkpointing.integrity import (  # noqa: F401  (re-exported for callers)
    COMMIT_FILE, META_FILE, is_complete, read_meta)
from ray_dhp.data.sampler import OldSamplerState, check_state

logger = logging.getLogger(__name__)

# -- what is saved -----------------------------------------------------------------------------

def model_state(engine) -> dict:
    """This rank's parameters by Hugging Face name (each encoder under its family's prefix,
    e.g. ``model.visual.``, ``model.`` for a vision side of two parts, ``model.audio_tower.``);
    DTensors stay sharded. Detached views: DCP loads into them in place. Under a policy with
    fp32 masters (bf16_mixed) these are the masters the rank updates, so a resume is exact."""
    out = {}
    for name, module in engine.shards.items():
        src = engine.opts.get(name, (None, None, None))[2] or module
        prefix = engine.family.encoder_prefix(name)
        out.update({prefix + n: p.detach() for n, p in src.named_parameters()})
    if engine.text_model is not None:
        src = engine.text_masters or engine.text_model
        out.update({n: p.detach() for n, p in src.named_parameters()})
    return out


def _modules(engine) -> dict:
    """{module name ("vision", "audio", ..., "text"): (module the optimizer steps, optimizer,
    scheduler)} for the modules this rank hosts (the fp32 masters' mirror module under
    bf16_mixed)."""
    out = {}
    for name, module in engine.shards.items():
        opt, sched, masters = engine.opts.get(name, (None, None, None))
        if opt is not None:
            out[name] = (masters.module if masters else module, opt, sched)
    if engine.text_model is not None and engine.text_opt is not None:
        m = engine.text_masters.module if engine.text_masters else engine.text_model
        out["text"] = (m, engine.text_opt, engine.text_sched)
    return out


def _optim_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # Flattened: every entry keyed by parameter name, so the state reshards like the parameters.
    return StateDictOptions(flatten_optimizer_state_dict=True)


def train_state(engine) -> dict:
    """The DCP state dict of ``engine``: model, optimizer and scheduler states of this rank."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = {"model": model_state(engine), "optim": {}, "sched": {}}
    for key, (module, opt, sched) in _modules(engine).items():
        state["optim"][key] = get_optimizer_state_dict(module, opt, options=_optim_options())
        state["sched"][key] = {k: sched.state_dict()[k] for k in _SCHED_KEYS}
    return state


# The schedule's position; the rest of a LambdaLR state (base/last lrs per param group) follows
# from the optimizer's param groups, which differ per rank under ZeRO-1.
_SCHED_KEYS = ("last_epoch", "_step_count")


def _load_sched(sched, opt, position: dict) -> None:
    state = sched.state_dict()
    state.update({k: int(position[k]) for k in _SCHED_KEYS})
    state["_last_lr"] = [g["lr"] for g in opt.param_groups]
    sched.load_state_dict(state)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()  # this worker's device only
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# -- save --------------------------------------------------------------------------------------

PROCESSOR_DIR = "processor"


@dataclass
class Snapshot:
    """What one rank writes for a checkpoint: the DCP ``state`` (live tensors, or host copies
    for a background write: `ray_dhp.checkpointing.staging`), its RNG states and, on rank 0,
    the metadata (without the file list) and the processor."""

    state: dict
    rng: dict
    meta: Optional[dict]
    processor: object = None


def capture(engine, sampler, processor=None) -> Snapshot:
    """This rank's `Snapshot` of ``engine`` and ``sampler`` now (no copy: the live tensors)."""
    meta = None
    if dist.get_rank() == 0:
        meta = {
            "format_version": FORMAT_VERSION, "step": engine.step_count, "family": engine.family.name,
            "layout": _layout_of(engine), "world_size": engine.groups.topology.world_size,
            "sampler": sampler.state_dict(),
            "model_config": engine.config.to_json_string(use_diff=False),
            "precision": engine.policy.name,
            "source_model": getattr(engine, "source_model", None),
            "modules": engine.cfg.optim.modules,  # per-module choices / LoRA (ray_dhp.config.tuning): export
        }
    return Snapshot(train_state(engine), _rng_state(), meta, processor if meta else None)


def save(directory: str, engine, sampler, processor=None) -> None:
    """Write this rank's part of a checkpoint of ``engine`` and ``sampler`` (collective).

    Args:
        directory: this rank's (empty or new) directory; give the same files to
            ``ray.train.report(checkpoint=Checkpoint.from_directory(directory))`` on every rank.
        engine: the `DHPEngine`; its ``step_count`` is the checkpoint's step.
        sampler: the `StepSampler` (its position is stored so the next step's data follows).
        processor: optional `VLProcessor`; rank 0 writes it to ``processor/`` so that
            `ray_dhp.export_hf` gives a directory with the model *and* its processor.
    """
    write(directory, capture(engine, sampler, processor))


def write(directory: str, snap: Snapshot, group=None, on_written=None) -> None:
    """Write ``snap`` into ``directory`` (collective over ``group``, default: the world): the DCP
    shards (checksummed as they are written), this rank's RNG file, then on rank 0 the file list
    and ``COMMIT``. ``on_written()`` runs once this rank's files are on disk, before the commit."""
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank()
    writer = HashingWriter(directory)
    dcp.save(snap.state, storage_writer=writer, process_group=group)
    try:
        rng, buf = f"rng_rank{rank}.pt", io.BytesIO()
        torch.save(snap.rng, buf)
        integrity.write_atomic(os.path.join(directory, rng), buf.getvalue())  # fsynced
        records, error = integrity.file_records(directory, [rng] + list(writer.chunks),
                                                writer.chunks), None
    except Exception as e:  # noqa: BLE001 - every rank must reach the gather below
        records, error = None, f"rank {rank}: {e!r}"
    if on_written is not None:
        on_written()
    parts = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, (records, error), group=group)  # every rank's files are on disk
    errors = [e for _, e in parts if e]
    if errors:
        raise RuntimeError(f"checkpoint {directory} not written: {'; '.join(errors)}")
    if rank == 0:
        if snap.processor is not None:
            snap.processor.save_pretrained(os.path.join(directory, PROCESSOR_DIR))
        files = integrity.file_records(directory, [".metadata"]
                                       + integrity.tree_files(directory, PROCESSOR_DIR))
        for part, _ in parts:
            files.update(part)
        integrity.commit(directory, {**snap.meta, "files": files})


# -- completeness and lookup -------------------------------------------------------------------

def resolve(path: str, verify: bool = True) -> str:
    """The checkpoint directory to load for ``path``, in one process.

    ``path`` may be a checkpoint (returned if complete and intact; if not, the newest complete,
    intact sibling with a lower step is used, with a warning) or a folder of checkpoints (e.g. a
    run directory: its newest complete, intact one). ``verify=False`` skips the content hashes
    (sizes only). Raises FileNotFoundError if there is none.
    """
    found = integrity.candidates(path)
    return _first_intact(path, found, integrity.verify) if verify else found[0]


def _candidates_collective(path: str) -> list:
    """`integrity.candidates` on every rank, checked to be the same list everywhere."""
    found = integrity.candidates(path)
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, [integrity.step_of(c) for c in found])
    if any(s != steps[0] for s in steps):
        raise RuntimeError(f"ranks resolved different checkpoints (steps {steps}; this rank: "
                           f"{found[0]}); is the checkpoint folder changing during the load?")
    return found


def _small_files_bad(c: str) -> list:
    """The small files of ``c`` (metadata, RNG, processor) whose checksum fails, checked by all
    ranks at once, each a share; the same list on every rank."""
    world, rank = dist.get_world_size(), dist.get_rank()
    every = [None] * world
    dist.all_gather_object(every, integrity.verify(c, part=(rank, world), shards=False))
    return [n for bad in every for n in bad]


def _corrupt_chunk(e: BaseException):
    """The `CorruptChunk` behind a DCP load failure (DCP gathers every rank's), else None."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(e, CorruptChunk):
        return e
    if isinstance(e, CheckpointException):
        for exc, _ in e.failures.values():
            if isinstance(exc, CorruptChunk):
                return exc
    return None


def _first_intact(path: str, found: list, check) -> str:
    """The first of ``found`` whose ``check`` lists no corrupt file."""
    for c in found:
        bad = check(c)
        if not bad:
            if c != found[0]:
                logger.warning("falling back to checkpoint %s", c)
            return c
        logger.warning("checkpoint %s is corrupt (content hash mismatch: %s); trying an older one",
                       c, ", ".join(bad[:5]))
    raise FileNotFoundError(f"no intact checkpoint for {path}: every complete one failed its "
                            f"content-hash check")


@contextlib.contextmanager
def local_dir(checkpoint):
    """A local directory for a ``ray.train.Checkpoint`` (downloaded if remote) or a path."""
    if not _is_ray_checkpoint(checkpoint):
        yield os.fspath(checkpoint)
        return
    import pyarrow.fs

    if isinstance(checkpoint.filesystem, pyarrow.fs.LocalFileSystem):
        yield checkpoint.path  # the storage dir itself: lets `resolve` look at siblings
        return
    with checkpoint.as_directory() as d:
        yield d


def latest_of_run():
    """What a (re)started Ray Train worker resumes from: the newest complete checkpoint in the
    run's storage folder when that is local, else Ray's registered latest (None if neither).

    Ray registers a checkpoint only once the controller has collected every rank's report, so a
    worker killed just after ``report`` returned can leave a complete, uploaded checkpoint that
    ``ray.train.get_checkpoint()`` does not know; the folder scan does not lose it.
    """
    import pyarrow.fs
    import ray.train

    try:
        storage = ray.train.get_context().get_storage()  # a Ray DeveloperAPI: be defensive
        local = isinstance(storage.storage_filesystem, pyarrow.fs.LocalFileSystem)
        folder = storage.experiment_fs_path if local else None
    except Exception as e:  # noqa: BLE001
        logger.debug("run folder not available: %s", e)
        folder = None
    if folder and os.path.isdir(folder):
        with contextlib.suppress(FileNotFoundError):
            return integrity.candidates(folder)[0]  # `load` verifies it (and falls back)
    return ray.train.get_checkpoint()


def _is_ray_checkpoint(obj) -> bool:
    # Not ``isinstance(obj, os.PathLike)``: ray.train.Checkpoint defines __fspath__ (to raise).
    return hasattr(obj, "as_directory") and hasattr(obj, "filesystem")


# -- load --------------------------------------------------------------------------------------

def load(checkpoint, engine, sampler=None) -> int:
    """Load a checkpoint into ``engine`` (and ``sampler``) at this run's layout (collective).

    Args:
        checkpoint: a ``ray.train.Checkpoint`` or a path (a checkpoint or a folder of them).
        engine: the freshly built `DHPEngine` to fill (parameters, optimizers, schedulers, step).
        sampler: the `StepSampler` to move to the stored data position (None: leave it).

    Returns:
        The step the checkpoint was written at (training continues with the next one).
    """
    with local_dir(checkpoint) as d:
        c = load_first_intact(d, lambda c, meta: _load_one(c, meta, engine, sampler),
                              check=lambda meta: check_compatible(meta, engine))
    logger.info("resumed from %s (step %d)", c, engine.step_count)
    return engine.step_count


def load_first_intact(path: str, load_one, check=None) -> str:
    """Collective: call ``load_one(directory, meta)`` on the newest complete checkpoint of
    ``path`` (a checkpoint or a folder of them) whose checksums hold, the same one on every rank;
    returns its directory. The small files are checked first (each rank a share); the shards are
    checked by ``load_one``'s ``dcp.load`` through `VerifyingReader` as it reads them — a
    mismatch on any rank fails the load on every rank (DCP gathers the read step's errors), and
    every rank moves on to the next older one. ``check(meta)`` may raise (not a fallback: e.g.
    another format or model)."""
    found = _candidates_collective(path)
    for c in found:
        meta = read_meta(c)
        if check is not None:
            check(meta)
        bad = _small_files_bad(c)
        if bad:
            logger.warning("checkpoint %s is corrupt (checksum mismatch: %s); trying an older "
                           "one", c, ", ".join(bad[:5]))
            continue
        try:
            load_one(c, meta)
        except BaseException as e:  # noqa: BLE001 - DCP raises CheckpointException (BaseException)
            bad = _corrupt_chunk(e)
            if bad is None:
                raise
            logger.warning("checkpoint %s is corrupt (%s); trying an older one", c, bad)
            continue
        if c != found[0]:
            logger.warning("falling back to checkpoint %s", c)
        return c
    raise FileNotFoundError(f"no intact checkpoint for {path}: every complete one failed its "
                            f"checksums")


def _load_one(d: str, meta: dict, engine, sampler) -> None:
    """Load checkpoint ``d`` (its shards' checksums verified as DCP reads them)."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    check_same_model(meta, engine)
    if sampler is not None:  # before the weights: an old data order stops the load early
        try:
            check_state(meta["sampler"])
        except OldSamplerState as e:
            raise ValueError(f"checkpoint {d}: {e}") from None
    state = train_state(engine)
    dcp.load(state, storage_reader=VerifyingReader(d, integrity.shard_chunks(meta)))
    for key, (module, opt, sched) in _modules(engine).items():
        set_optimizer_state_dict(module, opt, state["optim"][key], options=_optim_options())
        _load_sched(sched, opt, state["sched"][key])
    engine.params_from_masters()
    rng = os.path.join(d, f"rng_rank{dist.get_rank()}.pt")
    if meta.get("layout") == _layout_of(engine) and os.path.isfile(rng):
        _set_rng_state(torch.load(rng, weights_only=True))
    engine.step_count = int(meta["step"])
    if sampler is not None:
        sampler.load_state_dict(meta["sampler"])


def _layout_of(engine) -> dict:
    """The layout as plain data (``Topology`` as a dict), compared on load."""
    from dataclasses import asdict

    return asdict(engine.groups.topology)
