"""Sharded checkpoints of the DHP engine that load at any layout (torch.distributed.checkpoint).

What one checkpoint directory holds (every rank writes into its own temporary directory; Ray
Train merges them into one storage directory, so every file name is unique per rank):

* ``__<rank>_0.distcp`` + ``.metadata`` — one DCP checkpoint over all ranks with
  ``model.<name>`` (parameters by the model's own Hugging Face names; text parameters are
  DTensors under tensor parallelism, saved as shards), ``optim.{vision,text}`` (AdamW state
  keyed by parameter name, `get_optimizer_state_dict`) and ``sched.{vision,text}``. Replicated
  tensors (vision parameters on every vision rank, text parameters on every text replica) are
  stored once (DCP deduplicates identical keys). Loading into another layout's (DTensor) state
  dict reshards.
* ``rng_rank<r>.pt`` — each rank's RNG states (restored only at the same layout).
* ``ray_dhp_checkpoint.json`` (rank 0) — format version, step, family, the layout it was
  written with, sampler position and the transformers config (for `ray_dhp.export_hf`).
* ``COMMIT`` (rank 0, written last, after a barrier that follows every rank's shard write).

A checkpoint counts as complete only if ``COMMIT`` and the metadata exist and every file the
DCP metadata names is present with at least the recorded size: Ray copies each rank's
directory separately, so a crash can leave a directory with some ranks' files only.
`resolve` falls back to the newest complete sibling when given an incomplete one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import re

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
META_FILE = "ray_dhp_checkpoint.json"
COMMIT_FILE = "COMMIT"
VISION_PREFIX = "model.visual."


# -- what is saved -----------------------------------------------------------------------------

def model_state(engine) -> dict:
    """This rank's parameters by Hugging Face name (vision prefixed ``model.visual.``); DTensors
    stay sharded. Detached views: DCP loads into them in place. Under a policy with fp32
    masters (bf16_mixed) these are the masters the rank updates, so a resume is exact."""
    out = {}
    if engine.visual is not None:
        src = engine.vision_masters or engine.visual
        out.update({VISION_PREFIX + n: p.detach() for n, p in src.named_parameters()})
    if engine.text_model is not None:
        src = engine.text_masters or engine.text_model
        out.update({n: p.detach() for n, p in src.named_parameters()})
    return out


def _modules(engine) -> dict:
    """{"vision"|"text": (module the optimizer steps, optimizer, scheduler)} for the modules
    this rank hosts (the fp32 masters' mirror module under bf16_mixed)."""
    out = {}
    if engine.visual is not None and engine.vision_opt is not None:
        m = engine.vision_masters.module if engine.vision_masters else engine.visual
        out["vision"] = (m, engine.vision_opt, engine.vision_sched)
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
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -- save --------------------------------------------------------------------------------------

PROCESSOR_DIR = "processor"


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
    os.makedirs(directory, exist_ok=True)
    rank = dist.get_rank()
    dcp.save(train_state(engine), checkpoint_id=directory)
    torch.save(_rng_state(), os.path.join(directory, f"rng_rank{rank}.pt"))
    dist.barrier()  # every rank's shards and RNG file are on disk before COMMIT
    if rank == 0:
        if processor is not None:
            processor.save_pretrained(os.path.join(directory, PROCESSOR_DIR))
        meta = {
            "format_version": FORMAT_VERSION, "step": engine.step_count, "family": engine.family.name,
            "layout": _layout_of(engine), "world_size": engine.groups.topology.world_size,
            "sampler": sampler.state_dict(),
            "model_config": engine.config.to_json_string(use_diff=False),
            "precision": engine.policy.name,
            "source_model": getattr(engine, "source_model", None),
        }
        _write(os.path.join(directory, META_FILE), json.dumps(meta, indent=1))
        _write(os.path.join(directory, COMMIT_FILE), str(engine.step_count))


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# -- completeness and lookup -------------------------------------------------------------------

def read_meta(directory: str) -> dict:
    with open(os.path.join(directory, META_FILE)) as f:
        return json.load(f)


def is_complete(directory: str) -> bool:
    """True if ``directory`` holds a whole checkpoint (COMMIT, metadata and every shard file)."""
    d = os.fspath(directory)
    if not all(os.path.isfile(os.path.join(d, f)) for f in (COMMIT_FILE, META_FILE, ".metadata")):
        return False
    try:
        storage = dcp.FileSystemReader(d).read_metadata().storage_data
    except Exception as e:  # noqa: BLE001 - a truncated .metadata is an incomplete checkpoint
        logger.warning("unreadable DCP metadata in %s: %s", d, e)
        return False
    need: dict = {}
    for info in storage.values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in need.items():
        p = os.path.join(d, name)
        if not os.path.isfile(p) or os.path.getsize(p) < size:
            return False
    return True


def _step_of(directory: str) -> int:
    try:
        return int(read_meta(directory)["step"])
    except (OSError, ValueError, KeyError):
        m = re.search(r"(\d+)$", os.path.basename(os.path.normpath(directory)))
        return int(m.group(1)) if m else -1


def _complete_children(folder: str) -> list:
    subs = [os.path.join(folder, s) for s in os.listdir(folder)]
    return [s for s in subs if os.path.isdir(s) and is_complete(s)]


def _looks_like_checkpoint(directory: str) -> bool:
    """Holds checkpoint files (complete or not), as opposed to a folder of checkpoints."""
    return any(n in (".metadata", META_FILE, COMMIT_FILE) or n.endswith(".distcp")
               for n in os.listdir(directory))


def resolve(path: str) -> str:
    """The checkpoint directory to load for ``path``.

    ``path`` may be a checkpoint (returned if complete; if not, the newest complete sibling with
    a lower step is used, with a warning) or a folder of checkpoints (e.g. a run directory: its
    newest complete one). Raises FileNotFoundError if there is none.
    """
    path = os.path.abspath(os.fspath(path))
    if not os.path.isdir(path):
        raise FileNotFoundError(f"checkpoint {path} does not exist")
    if is_complete(path):
        return path
    if not _looks_like_checkpoint(path):
        children = _complete_children(path)
        if not children:
            raise FileNotFoundError(f"no complete checkpoint in {path}")
        return max(children, key=_step_of)
    step = _step_of(path)
    older = [c for c in _complete_children(os.path.dirname(path)) if _step_of(c) < step or step < 0]
    if not older:
        raise FileNotFoundError(f"checkpoint {path} is incomplete (torn write) and no complete "
                                f"earlier checkpoint was found next to it")
    best = max(older, key=_step_of)
    logger.warning("checkpoint %s is incomplete; falling back to %s", path, best)
    return best


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
            return resolve(folder)
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
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with local_dir(checkpoint) as d:
        d = resolve(d)
        meta = read_meta(d)
        _check_same_choice(int(meta["step"]), d)
        _check_compatible(meta, engine)
        state = train_state(engine)
        dcp.load(state, checkpoint_id=d)
        for key, (module, opt, sched) in _modules(engine).items():
            set_optimizer_state_dict(module, opt, state["optim"][key], options=_optim_options())
            _load_sched(sched, opt, state["sched"][key])
        engine.params_from_masters()
        rng = os.path.join(d, f"rng_rank{dist.get_rank()}.pt")
        if meta.get("layout") == _layout_of(engine) and os.path.isfile(rng):
            _set_rng_state(torch.load(rng, weights_only=False))
    engine.step_count = int(meta["step"])
    if sampler is not None:
        sampler.load_state_dict(meta["sampler"])
    logger.info("resumed from %s (step %d)", d, engine.step_count)
    return engine.step_count


def _check_same_choice(step: int, directory: str) -> None:
    """Every rank must load the same checkpoint (each resolves it from the file system)."""
    steps = [None] * dist.get_world_size()
    dist.all_gather_object(steps, step)
    if len(set(steps)) != 1:
        raise RuntimeError(f"ranks resolved different checkpoints (steps {steps}; this rank: "
                           f"{directory}); is the checkpoint folder changing during the load?")


def _layout_of(engine) -> dict:
    """The layout as plain data (``Topology`` as a dict), compared on load."""
    from dataclasses import asdict

    return asdict(engine.groups.topology)


def _check_compatible(meta: dict, engine) -> None:
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ValueError(f"checkpoint format version {version!r} is not supported by this ray_dhp "
                         f"(reads up to {FORMAT_VERSION}); upgrade ray_dhp.")
    if meta.get("family") != engine.family.name:
        raise ValueError(f"checkpoint holds a {meta.get('family')} model but this run trains a "
                         f"{engine.family.name} model; use DHPConfig(model=...) of the same family.")

