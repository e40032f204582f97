"""Random init one parameter at a time, bit-identical to ``cls._from_config`` (the reference).

The model is constructed exactly as the single-process reference constructs it (same class,
same ``_from_config`` call, same dtype), with two differences: every parameter is moved to the
``meta`` device as soon as it is registered (buffers stay real, so rotary ``inv_freq`` and the
like are computed by the model's own code), and a dispatch mode records every operation that
writes into a parameter — ``torch.nn`` default init during ``__init__``, then transformers'
``_init_weights`` in ``post_init``. Nothing is drawn from the random generator while recording.

`InitRecord.replay` then runs the recorded operations again, in the same order, from the same
seed, on real CPU tensors. Every random draw the reference makes is made again on a tensor of
the same shape, dtype and strides, so the generator advances exactly as in the reference; only
the parameters a rank keeps get a real buffer (from their last full overwrite on), handed to a
sink when their last recorded operation ran, and dropped. At most one full parameter (plus the
few of the module being initialised) is alive at a time, and the replay stops once the last kept
parameter is final (a vision rank never draws the language model's init).

Temporaries are replayed too: a draw into a scratch tensor that is then copied into a
parameter (Qwen3.5 draws its ``A_log`` into ``torch.empty(...)`` and takes the log), or a draw
into a real tensor in a module's ``__init__`` (its writes are recorded; the tensor stays alive
while recording so its storage is not confused with a later one; every meta tensor a recorded op
touched stays alive too, for the same reason: storage keys are addresses). What cannot be replayed this
way is refused with an error naming the parameter: an out-of-place random draw on real tensors
while constructing, or a parameter whose value depends on another parameter.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves, tree_map

# aten ops (overload packet names) that draw from the default generator.
RANDOM_OPS = frozenset({
    "uniform_", "normal_", "normal", "bernoulli_", "bernoulli", "random_", "exponential_",
    "geometric_", "cauchy_", "log_normal_", "rand", "randn", "randint", "randperm", "rand_like",
    "randn_like", "randint_like", "multinomial", "native_dropout", "poisson", "trunc_normal_",
})
# In-place ops whose result does not depend on the previous contents of their target.
OVERWRITE_OPS = frozenset({
    "uniform_", "normal_", "bernoulli_", "random_", "exponential_", "geometric_", "cauchy_",
    "log_normal_", "fill_", "zero_", "copy_", "trunc_normal_",
})
# ``torch.nn.init`` functions recorded as whole calls: on a meta tensor they return at once
# (``trunc_normal_``: rejection sampling, as many draws as the values need), so their aten ops
# are never seen; replayed, the call on the real tensor draws exactly what the reference drew.
WHOLE_CALLS = ("trunc_normal_",)


@dataclass(frozen=True)
class MetaRef:
    """A meta tensor argument of a recorded op: a view into the storage of ``storage``."""

    storage: int
    size: tuple
    stride: tuple
    offset: int
    dtype: torch.dtype


@dataclass
class RecordedOp:
    func: object
    args: tuple
    kwargs: dict
    target: Optional[MetaRef]  # the meta tensor the op writes into (None: a read-only op)

    @property
    def name(self) -> str:
        packet = getattr(self.func, "overloadpacket", None)  # an aten op, or a whole init call
        return packet.__name__ if packet is not None else self.func.__name__

    @property
    def is_random(self) -> bool:
        return self.name in RANDOM_OPS


def storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _snapshot(x):
    if isinstance(x, torch.Tensor) and x.is_meta:
        return MetaRef(storage_key(x), tuple(x.size()), tuple(x.stride()), x.storage_offset(), x.dtype)
    return x


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []
        self.foreign_random: list = []  # out-of-place random ops on real tensors while constructing
        # storage -> (op, tensor) of out-of-place draws not (yet) seen to become a parameter
        self.foreign: dict = {}
        # Real (non-meta) tensors a random op wrote into while constructing (e.g. a draw in a
        # module's ``__init__`` whose value is overwritten later): kept alive so their storage key
        # stays theirs; their writes are recorded and replayed like those of a meta temporary.
        self.temps: dict = {}
        # Every meta tensor a recorded op touched, kept alive until recording ends: a storage key
        # is a storage's address, and a freed meta temporary's address can be reused by a later
        # parameter (Qwen3.5's ``A_log`` scratch and then ``lm_head.weight``), which would make
        # the replay read that parameter. Meta tensors hold no memory.
        self.alive: list = []

    def _snap(self, x):
        if isinstance(x, torch.Tensor) and not x.is_meta and storage_key(x) in self.temps:
            return MetaRef(-storage_key(x), tuple(x.size()), tuple(x.stride()), x.storage_offset(),
                           x.dtype)
        return _snapshot(x)

    def _record(self, func, args, kwargs, target) -> None:
        self.alive.extend(x for x in tree_leaves((args, kwargs, target))
                          if isinstance(x, torch.Tensor) and x.is_meta)
        self.ops.append(RecordedOp(func, tree_map(self._snap, args), tree_map(self._snap, kwargs),
                                   None if target is None else self._snap(target)))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        leaves = tree_leaves((args, kwargs))
        name = func.overloadpacket.__name__
        if not any(isinstance(a, torch.Tensor) and a.is_meta for a in leaves):
            written = _written_arg(func, args, kwargs, meta=False)
            if written is not None and (name in RANDOM_OPS or storage_key(written) in self.temps):
                self.temps[storage_key(written)] = written
                self._record(func, args, kwargs, written)
            elif name in RANDOM_OPS and isinstance(out, torch.Tensor):
                # an out-of-place draw (``nn.Parameter(torch.randn(d))``, CLIP's class
                # embedding): replayed as a generator advance; allowed only if its result
                # becomes a parameter (moved to meta, fully written later by the init)
                self.foreign[storage_key(out)] = (str(func), out)
                # the dtype explicit: the draw was made under the construction's default dtype
                self._record(func, args, {**kwargs, "dtype": out.dtype}, None)
            elif name in RANDOM_OPS:
                self.foreign_random.append(str(func))
            elif isinstance(out, torch.Tensor) and written is None:
                # a draw scaled out of place (``nn.Parameter(scale * torch.randn(d))``, Llama 4's
                # class embedding): the result is what must become a parameter
                src = next((storage_key(a) for a in leaves if isinstance(a, torch.Tensor)
                            and storage_key(a) in self.foreign), None)
                if src is not None:
                    self.foreign[storage_key(out)] = (self.foreign.pop(src)[0], out)
            return out
        target = _written_arg(func, args, kwargs, meta=True)
        if target is not None or name in RANDOM_OPS:
            self._record(func, args, kwargs, target)
        return out


def _written_arg(func, args, kwargs, meta: bool) -> Optional[torch.Tensor]:
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = kwargs.get(a.name) if (a.kwarg_only or i >= len(args)) else args[i]
        if isinstance(v, torch.Tensor) and v.is_meta == meta:
            return v
    return None


@contextlib.contextmanager
def parameters_on_meta(on_real: Optional[Callable[[torch.Tensor], None]] = None):
    """Register every new parameter on the meta device (buffers stay where they are made);
    ``on_real(tensor)``: told of each real tensor a parameter was made of."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        original(module, name, param)
        p = module._parameters.get(name)
        if p is not None and not p.is_meta:
            if on_real is not None:
                on_real(p)
            module._parameters[name] = type(p)(p.to("meta"), requires_grad=p.requires_grad)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


class InitRecord:
    """The recorded init operations of one meta-constructed model."""

    def __init__(self, model: torch.nn.Module, ops: list):
        self.ops = ops
        self.names: dict = {}    # storage -> parameter names (tied parameters share one storage)
        self.params: dict = {}   # storage -> meta parameter
        for n, p in model.named_parameters(remove_duplicate=False):
            self.names.setdefault(storage_key(p), []).append(n)
            self.params[storage_key(p)] = p
        self.first_live, self.last = {}, {}
        for i, op in enumerate(ops):
            t = op.target
            if t is None or t.storage not in self.params:
                continue
            self.last[t.storage] = i
            if op.name in OVERWRITE_OPS and self._covers(t) and not self._reads_params(op):
                self.first_live[t.storage] = i
        # temporaries (written storages that are no parameter: a draw into a scratch tensor that
        # is then copied into a parameter): always replayed, dropped after their last use
        self.temp_last: dict = {}
        for i, op in enumerate(ops):
            for r in tree_leaves((op.args, op.kwargs, op.target)):
                if isinstance(r, MetaRef) and r.storage not in self.params:
                    self.temp_last[r.storage] = i
        for s, names in self.names.items():
            if s not in self.first_live:
                raise ValueError(f"random init: parameter {names[0]} is never fully written by the "
                                 f"model's init; it cannot be reproduced one parameter at a time")

    def _reads_params(self, op: RecordedOp) -> bool:
        """True if the op reads a parameter other than its target (its value depends on it)."""
        reads = [x for x in tree_leaves((op.args, op.kwargs)) if isinstance(x, MetaRef)]
        return any(r != op.target and r.storage in self.params for r in reads)

    def _covers(self, ref: MetaRef) -> bool:
        p = self.params[ref.storage]
        return ref.size == tuple(p.size()) and ref.stride == tuple(p.stride()) and ref.offset == p.storage_offset()

    def replay(self, seed: int, wanted: set, sink: Callable[[list, torch.Tensor], None]) -> None:
        """Re-run the init from ``seed``; call ``sink(names, full_tensor)`` once for every
        parameter storage in ``wanted`` (``names``: all its names), as soon as it is final."""
        live, temps = {}, {}
        pending = set(wanted)
        with torch.random.fork_rng(devices=[]), torch.no_grad():
            torch.manual_seed(seed)
            for i, op in enumerate(self.ops):
                if not pending:  # later draws cannot change what was handed out
                    break
                s = op.target.storage if op.target is not None else None
                if s in wanted and i >= self.first_live[s]:
                    if s not in live:
                        p = self.params[s]
                        live[s] = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype)
                    _run(op, lambda ref: self._view(live, temps, ref, op))
                    if i == self.last[s]:
                        sink(self.names[s], live.pop(s))
                        pending.discard(s)
                elif s is not None and s not in self.params:  # a temporary
                    _run(op, lambda ref: _temp(temps, ref))
                elif op.is_random:  # only the generator's advance matters: a throw-away tensor
                    _run(op, self._scratch)
                for key in [k for k in temps if self.temp_last.get(k) == i]:
                    del temps[key]

    def _view(self, live: dict, temps: dict, ref: MetaRef, op: RecordedOp) -> torch.Tensor:
        if ref.storage not in self.params:
            return _temp(temps, ref)
        base = live.get(ref.storage)
        if base is None:
            what = self.names.get(ref.storage, ["a tensor that is not a parameter"])[0]
            raise ValueError(f"random init: {op.func} writes {self.names[op.target.storage][0]} "
                             f"from {what}; this cannot be replayed one parameter at a time")
        return base.as_strided(ref.size, ref.stride, ref.offset)

    def _scratch(self, ref: MetaRef) -> torch.Tensor:
        p = self.params.get(ref.storage)
        if p is not None:
            base = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype)
        else:
            n = ref.offset + 1 + sum((s - 1) * st for s, st in zip(ref.size, ref.stride))
            base = torch.empty(max(n, 1), dtype=ref.dtype)
        return base.as_strided(ref.size, ref.stride, ref.offset)


def _extent(ref: MetaRef) -> int:
    return ref.offset + 1 + sum((s - 1) * st for s, st in zip(ref.size, ref.stride))


def _temp(temps: dict, ref: MetaRef) -> torch.Tensor:
    """The replay's buffer of a temporary (made on first use, remade if a later temporary that
    got the same storage key needs more room)."""
    base = temps.get(ref.storage)
    if base is None or base.numel() < _extent(ref) or base.dtype != ref.dtype:
        base = temps[ref.storage] = torch.empty(max(_extent(ref), 1), dtype=ref.dtype)
    return base.as_strided(ref.size, ref.stride, ref.offset)


def _run(op: RecordedOp, resolve) -> None:
    def real(x):
        return resolve(x) if isinstance(x, MetaRef) else x

    op.func(*tree_map(real, op.args), **tree_map(real, op.kwargs))


@contextlib.contextmanager
def _whole_calls_recorded(rec: "_Recorder"):
    """Record `WHOLE_CALLS` on meta tensors as one op each (torch's and transformers' names)."""
    import sys

    init_fns = getattr(sys.modules.get("transformers.initialization"), "TORCH_INIT_FUNCTIONS", {})
    saved = []
    for name in WHOLE_CALLS:
        original = getattr(torch.nn.init, name)

        def recorded(tensor, *args, _original=original, **kwargs):
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                rec._record(_original, (tensor, *args), kwargs, tensor)
                return tensor
            return _original(tensor, *args, **kwargs)

        saved.append((torch.nn.init, name, original))
        setattr(torch.nn.init, name, recorded)
        if name in init_fns:
            saved.append((init_fns, name, init_fns[name]))
            init_fns[name] = recorded
    try:
        yield
    finally:
        for holder, name, original in saved:
            if isinstance(holder, dict):
                holder[name] = original
            else:
                setattr(holder, name, original)


def construct_recorded(build: Callable[[], torch.nn.Module]):
    """Run ``build()`` with parameters on meta and their init recorded; return (model, record)."""
    rec = _Recorder()
    with torch.random.fork_rng(devices=[]), _whole_calls_recorded(rec), \
            parameters_on_meta(lambda t: rec.foreign.pop(storage_key(t), None)), rec:
        model = build()
    stray = rec.foreign_random + [op for op, _ in rec.foreign.values()]
    if stray:
        raise ValueError(
            f"random init: constructing {type(model).__name__} draws random numbers outside its "
            f"parameters ({sorted(set(stray))}); sharded random init cannot reproduce "
            f"it. Load the model from a directory instead.")
    return model, InitRecord(model, rec.ops)
