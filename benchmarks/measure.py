"""What the benchmarks measure inside a rank: saved activations, state bytes, collectives, RSS.

* `ActivationCounter`: bytes of the tensors autograd saves for backward during a forward
  (``torch.autograd.graph.saved_tensors_hooks``), de-duplicated by storage (a storage saved by
  several ops counts once, at its full size), parameters excluded. Bytes are attributed to
  ``"vision"`` while any sub-module of the vision tower is running (module hooks; `watch` names
  other modules' tags), else ``"text"``.
* `CollectiveCounter`: calls and bytes sent (input buffer size) per collective, by wrapping the
  ``torch.distributed`` functions and DTensor's functional collectives by name (the outermost call
  counts once; DeepSpeed's comm layer and FSDP2 go through ``torch.distributed``).
* `state_bytes`: local bytes of parameters and optimizer state (DTensor / FSDP2 shards count
  their local shard; DeepSpeed ZeRO-3 its partitions).
* `RssSampler`: peak resident set size of this process while a labelled region runs.
* `measure_engine_step`: an engine's model state, saved activations and optimizer-step peak on
  one rank, the three points `ray-dhp plan` prints (``benchmarks/plan_accuracy.py``). On CPU;
  what it cannot see on a GPU: the CUDA context, NCCL's communicator buffers, the caching
  allocator's rounding and fragmentation, kernel workspaces (cuBLAS, flash attention) and
  autocast's weight-cast cache; the planner's device margin stands for the first four
  (`ray_dhp.planning.devices`).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import defaultdict

import torch

from benchmarks.alloc_events import STEP_MARK, python_storages, step_peak_bytes  # noqa: F401


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def _is_param(t: torch.Tensor) -> bool:
    while t is not None:
        if isinstance(t, torch.nn.Parameter):
            return True
        t = t._base
    return False


class ActivationCounter:
    """Counts saved-for-backward bytes per tag within ``with counter.count():``."""

    def __init__(self):
        self.bytes = defaultdict(int)
        self._seen: set = set()
        self._tags: list = []  # the innermost watched module running
        self._params: set = set()  # storages of parameters (`count(params=...)`): never counted

    def watch_vision(self, vision_module: torch.nn.Module) -> list:
        """Tag work inside any sub-module of ``vision_module`` as "vision"; returns hook handles."""
        return self.watch(vision_module, "vision")

    def watch(self, module: torch.nn.Module, tag: str) -> list:
        """Tag work inside any sub-module of ``module`` as ``tag``; returns hook handles."""
        handles = []
        for m in module.modules():
            handles.append(m.register_forward_pre_hook(lambda *_: self._enter(tag)))
            handles.append(m.register_forward_hook(self._leave))
        return handles

    def _enter(self, tag: str) -> None:
        self._tags.append(tag)

    def _leave(self, *_) -> None:  # a forward hook: returns None (keeps the module's output)
        self._tags.pop()

    def _pack(self, t):
        if not _is_param(t):
            loc = _local(t)
            try:
                st = loc.untyped_storage()
                key = (st.data_ptr(), st.nbytes())
            except (RuntimeError, NotImplementedError):  # storage-less tensor subclasses
                key, st = (id(loc), loc.numel() * loc.element_size()), None
            if key[0] in self._params:  # a view of a parameter's local shard (e.g. one expert's)
                return t
            if key not in self._seen:
                self._seen.add(key)
                self.bytes[self._tags[-1] if self._tags else "text"] += key[1]
        return t

    @contextlib.contextmanager
    def count(self, params=()):
        """Count within the block; ``params``: parameters whose local storages (views of them:
        a DTensor shard's per-expert slices) are weights, not activations."""
        self.bytes.clear()
        self._seen.clear()
        self._params = {_local(p).untyped_storage().data_ptr() for p in params}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
            yield self

    def as_dict(self) -> dict:
        """``vision``, ``text`` (0 when absent), any other watched tag, and ``total``."""
        return {"vision": int(self.bytes["vision"]), "text": int(self.bytes["text"]),
                **{k: int(v) for k, v in self.bytes.items()}, "total": int(sum(self.bytes.values()))}


# -- collectives --------------------------------------------------------------------------------

_DIST_NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single", "_all_gather_base",
               "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "_reduce_scatter_base",
               "all_to_all", "all_to_all_single", "broadcast", "reduce", "send", "recv", "isend", "irecv",
               "all_gather_coalesced", "all_reduce_coalesced", "_all_gather_base_coalesced")
_FUNCOL_NAMES = ("all_reduce", "all_gather_tensor", "all_gather_single", "all_gather_tensor_autograd",
                 "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all_single",
                 "all_to_all_single_autograd", "broadcast", "all_reduce_coalesced",
                 "all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced")


_INPUT_ARGS = ("input_tensor", "input", "self", "tensor", "input_tensor_list", "input_list", "inputs",
               "input_tensors", "tensors")


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        x = _local(x)
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


def _sent_bytes(fn, args, kwargs) -> int:
    """Bytes of the input buffer(s) this rank contributes (the argument named like an input)."""
    import inspect

    try:
        bound = inspect.signature(fn).bind_partial(*args, **kwargs).arguments
    except (TypeError, ValueError):
        bound = {}
    for name in _INPUT_ARGS:
        if name in bound:
            return _nbytes(bound[name])
    return _nbytes(args[0]) if args else 0


class CollectiveCounter:
    """Wraps collectives by name while installed (``with counter.installed():``); thread-safe enough
    for one training thread."""

    def __init__(self):
        self.stats = defaultdict(lambda: [0, 0])
        self.enabled = False
        self._inside = threading.local()

    def _wrap(self, prefix, name, fn):
        def wrapper(*args, **kwargs):
            outer = not getattr(self._inside, "on", False)
            if outer and self.enabled:
                s = self.stats[f"{prefix}.{name}"]
                s[0] += 1
                s[1] += _sent_bytes(fn, args, kwargs)
            self._inside.on = True
            try:
                return fn(*args, **kwargs)
            finally:
                if outer:
                    self._inside.on = False
        wrapper.__wrapped__ = fn
        return wrapper

    @contextlib.contextmanager
    def installed(self):
        import torch.distributed as dist
        import torch.distributed._functional_collectives as funcol
        import torch.distributed.distributed_c10d as c10d

        saved = []
        for mod, prefix, names in ((dist, "dist", _DIST_NAMES), (c10d, "dist", _DIST_NAMES),
                                   (funcol, "funcol", _FUNCOL_NAMES)):
            for n in names:
                if hasattr(mod, n):
                    saved.append((mod, n, getattr(mod, n)))
                    setattr(mod, n, self._wrap(prefix, n, getattr(mod, n)))
        try:
            yield self
        finally:
            for mod, n, fn in reversed(saved):
                setattr(mod, n, fn)

    @contextlib.contextmanager
    def counting(self):
        self.stats.clear()
        self.enabled = True
        try:
            yield self
        finally:
            self.enabled = False

    def as_dict(self) -> dict:
        return {k: {"calls": v[0], "bytes": v[1]} for k, v in sorted(self.stats.items())}


# -- state and RSS ------------------------------------------------------------------------------

def tensor_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        t = _local(t)
        key = (t.data_ptr(), t.numel()) if t.numel() else (id(t), 0)
        if key in seen:
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    return total


def optimizer_bytes(opt) -> int:
    if opt is None:
        return 0
    return tensor_bytes(v for st in opt.state.values() for v in st.values())


def params_bytes(params) -> int:
    """Local bytes of parameters (DeepSpeed ZeRO-3: the rank's partition ``ds_tensor``)."""
    out = []
    for p in params:
        out.append(p.ds_tensor if hasattr(p, "ds_tensor") else p)
    return tensor_bytes(out)


def rss_bytes() -> int:
    import psutil

    return psutil.Process().memory_info().rss


class RssSampler:
    """Background thread: the peak RSS seen while ``with sampler.region(label):`` is active."""

    def __init__(self, interval_s: float = 0.005):
        self.peak = defaultdict(int)
        self._label = None
        self._stop = threading.Event()
        self._interval = interval_s
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        import psutil

        proc = psutil.Process()
        while not self._stop.is_set():
            label = self._label
            if label is not None:
                self.peak[label] = max(self.peak[label], proc.memory_info().rss)
            time.sleep(self._interval)

    @contextlib.contextmanager
    def region(self, label: str):
        self.peak[label] = max(self.peak[label], rss_bytes())
        self._label = label
        try:
            yield
        finally:
            self._label = None
            self.peak[label] = max(self.peak[label], rss_bytes())

    def close(self):
        self._stop.set()


# -- one engine step, measured at the plan's three points ------------------------------------

def measure_engine_step(engine, first: list, second: list, repeats: int = 2) -> dict:
    """The plan's three points on this rank of a `ray_dhp.step.engine.DHPEngine`, measured over
    its second step (``first`` makes the AdamW moments):

    * ``state``: the engine's model-state tensors (`ray_dhp.step.updates.measure_engine_state`:
      weights, the gradients held at the step, fp32 masters, AdamW moments; ``host``: the part
      offloaded to the host);
    * ``saved``: bytes autograd saves for backward during the step's forward (`ActivationCounter`,
      one micro-batch: call with ``micro_batches=1``), by module (every encoder this rank hosts,
      by name; the rest is ``text``);
    * ``step_peak``: the live bytes' maximum during `optimizer_step` (`step_peak_bytes`), from
      the state held before the forward (weights, masters, moments; gradients freed) plus the
      CPU allocator's running sum since then (the gradients, what the forward left alive, the
      reduction buckets and the update's temporaries); the larger of ``repeats`` steps on the
      same micro-batch: which thread frees a block gloo's worker held is a race, and where the
      profiler misses such a free and the address is handed out again the sum can drop a
      bucket's bytes early (seen: a rank's step peak measured at its state plus 0.4%, the next
      run's 35% higher, its plan 1.000), never add them;
    * ``lm_rows``: ``[rows, tokens]`` of the language model's input (its padded or packed rows);
    * ``fsdp_work``: at ZeRO stage 3, the most FSDP2 holds unsharded during the forward and
      backward (`benchmarks.fsdp_sampling`); None without a stage-3 module.
    """
    from benchmarks.fsdp_sampling import fsdp_groups, sampling
    from torch.profiler import ProfilerActivity, profile, record_function

    engine.step(first)
    st = engine.state_bytes()
    base = st["weights"] + st["masters"] + st["optimizer"] - st["host"]
    counter = ActivationCounter()
    handles, rows = [], []
    for name, module in engine.shards.items():
        handles += counter.watch(module, name)
    if engine.text_model is not None:
        handles.append(engine.text_model.register_forward_pre_hook(
            lambda _m, args, kw: rows.append(_rows(args, kw)), with_kwargs=True))
    peak, groups = 0, fsdp_groups(_modules(engine))
    fsdp_samples: list = []
    for i in range(repeats):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True,
                     record_shapes=True) as prof:
            with contextlib.ExitStack() as stack:
                if i == 0:
                    stack.enter_context(counter.count(params=_parameters(engine)))
                    if groups:
                        fsdp_samples = stack.enter_context(sampling(groups))
                engine.forward_backward(second, last=True)
            with record_function(STEP_MARK):
                engine.optimizer_step()
        peak = max(peak, step_peak_bytes(prof, base, alive=python_storages()))
        for h in handles:
            h.remove()
        handles = []
        st = engine.state_bytes()
        base = st["weights"] + st["masters"] + st["optimizer"] - st["host"]
    return {"state": st["total"] - st["host"], "state_parts": st, "saved": counter.as_dict(),
            "step_peak": peak, "lm_rows": rows[0] if rows else None,
            "fsdp_work": max(fsdp_samples) if fsdp_samples else None}


def _modules(engine) -> list:
    return list(engine.shards.values()) + ([engine.text_model] if engine.text_model is not None else [])


def _parameters(engine) -> list:
    return [p for m in _modules(engine) for p in m.parameters()]


def _rows(args, kw) -> list:
    x = kw.get("input_ids") if kw.get("input_ids") is not None else kw.get("inputs_embeds")
    if x is None and args:
        x = args[0]
    return list(x.shape[:2])
