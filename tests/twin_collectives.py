"""Every collective a rank issues, seen where torch dispatches it (the NCCL twin's collective log).

Our own collectives (``dist.all_reduce`` ...), DTensor's (TP redistributes, ``loss_parallel``,
``full_tensor``: functional collectives, ``torch.ops._c10d_functional.*``) and FSDP2's
all-gathers / reduce-scatters (``dist.all_gather_single`` / ``reduce_scatter_single``, i.e.
``torch.ops.c10d._allgather_base_`` / ``_reduce_scatter_base_``) all reach the dispatcher as one
of the ops in `COLLECTIVES` (read from the registered schemas of the ``c10d``,
``_c10d_functional(_autograd)`` and ``_dtensor`` namespaces). `CollectiveLog` hands each of them
to a callback with what NCCL needs equal on every member: the op (one name per NCCL operation,
whichever API issued it), dtypes, shapes (not for the all-to-alls, whose splits may differ) and
the root of a rooted op; and, for the error messages only, the op as dispatched, the torch frame
that issued it (``via``: FSDP2's or DTensor's code) and the frame above it (``site``).

A ``TorchDispatchMode`` sees the same ops but runs Python for every op of the body (measured:
about +30% CPU per rank on a parity step); `CollectiveLog` registers a kernel for the
collectives only.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import NamedTuple

import torch

_TORCH = os.path.dirname(torch.__file__) + os.sep
_HERE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
# The collective APIs themselves: a ``via`` frame is the first torch frame outside them.
_API = tuple(os.path.join(_TORCH, "distributed", f) for f in
             ("distributed_c10d.py", "c10d_logger.py", "_functional_collectives.py"))
_DISTRIBUTED = os.path.join(_TORCH, "distributed") + os.sep

# One name per NCCL operation (c10d's and the functional API's spellings of it map together).
_NAMES = {"allreduce": "all_reduce", "allgather": "all_gather", "_allgather_base": "all_gather_into_tensor",
          "_reduce_scatter_base": "reduce_scatter_tensor", "alltoall_base": "all_to_all_single",
          "alltoall": "all_to_all", "allreduce_coalesced": "all_reduce_coalesced",
          "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced",
          "allgather_coalesced": "all_gather_coalesced", "shard_dim_alltoall": "all_to_all_single"}
_NOT_COLLECTIVES = {"send", "recv_", "recv_any_source_", "isend", "irecv", "batch_p2p_ops",  # p2p: see NcclTwin
                    "wait_tensor", "check_for_nan", "_wrap_tensor_autograd"}
_GROUP_ARGS = ("process_group", "group_name")
_ROOT_ARGS = ("root_rank", "src")
# The tensors whose shapes every member must agree on: the inputs, except where only the root
# has them (scatter) or where they may differ per rank and the outputs say it all (all_gather).
_PAYLOAD = {"allgather_": "output_tensors", "allgather_coalesced_": "output_lists",
            "scatter_": "output_tensors"}
_PAYLOAD_ARGS = ("input", "inputs", "input_tensor", "input_tensors", "input_list", "tensors", "tensor")
_VARIABLE = ("all_to_all_single", "all_to_all")  # splits may differ between ranks


class Spec(NamedTuple):
    name: str             # the NCCL operation
    group: int            # argument index of the process group (a ScriptObject) or its name
    payload: int | None   # argument index of the tensors to compare
    root: int | None      # argument index of the root rank (rooted ops)


def _spec(op) -> Spec | None:
    base = op._schema.name.split("::")[1]
    if base in _NOT_COLLECTIVES:
        return None
    args = [a.name for a in op._schema.arguments]
    group = next((i for i, a in enumerate(args) if a in _GROUP_ARGS), None)
    if group is None:
        return None
    stem = base.rstrip("_").removesuffix("_out")
    name = _NAMES.get(stem, stem)
    wanted = _PAYLOAD.get(base)
    payload = next((i for i, a in enumerate(args) if a == wanted or (wanted is None and a in _PAYLOAD_ARGS)),
                   None)
    root = next((i for i, a in enumerate(args) if a in _ROOT_ARGS), None)
    return Spec(name, group, None if name in _VARIABLE else payload, root)


def _collectives() -> dict:
    out = {}
    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualified.partition("::")
        if ns not in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
            continue
        packet = getattr(getattr(torch.ops, ns), name.split(".")[0])
        for overload in packet.overloads():
            op = getattr(packet, overload)
            spec = _spec(op)
            if spec is not None:
                out[op] = spec
    return out


COLLECTIVES: dict = _collectives()  # OpOverload -> Spec


def _tensors(obj) -> list:
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return [obj] if isinstance(obj, torch.Tensor) else []


def describe(spec: Spec, args) -> tuple:
    """What every member must issue identically: (op, dtypes, shapes or None, root or None)."""
    ts = _tensors(args[spec.payload]) if spec.payload is not None and spec.payload < len(args) else []
    if spec.name in _VARIABLE:
        ts = _tensors(args[:spec.group])
    shapes = None if spec.payload is None else tuple(tuple(t.shape) for t in ts)
    root = args[spec.root] if spec.root is not None and spec.root < len(args) else None
    return (spec.name, tuple(sorted({str(t.dtype) for t in ts})), shapes, root)


def _rel(path: str) -> str:
    for base, prefix in ((_TORCH, "torch/"), (_ROOT, "")):
        if path.startswith(base):
            return prefix + path[len(base):]
    return path.split("site-packages" + os.sep)[-1]


def call_site() -> tuple:
    """(via, site): the first ``torch.distributed`` frame outside the collective APIs (FSDP2's or
    DTensor's code that issued the op; None for a direct ``dist.*`` call) and the first frame
    outside torch above it (``file:line function``: ours, or a transformers model's)."""
    f, via = sys._getframe(2), None
    while f is not None:
        path = f.f_code.co_filename
        if path.startswith(_TORCH):
            if via is None and path.startswith(_DISTRIBUTED) and not path.startswith(_API):
                via = f"{_rel(path)}:{f.f_lineno}"
        elif not path.startswith(_HERE + "twin_collectives") and not path.startswith(_HERE + "nccl_twin"):
            return via, f"{_rel(path)}:{f.f_lineno} {f.f_code.co_name}"
        f = f.f_back
    return via, None


class CollectiveLog:
    """Context manager: ``record(spec, op, args)`` is called before each collective in
    `COLLECTIVES` runs, in any thread. A kernel of ours at the ``ADInplaceOrView`` dispatch key
    (below autograd and the tensor subclasses, above the backend; no collective has one of its
    own) records the op and redispatches it to the backend; every other op pays nothing. A
    collective run inside another (a functional collective's kernel calls a c10d op) is not
    recorded twice. Inference tensors (``torch.inference_mode``) skip that key: not seen."""

    def __init__(self, record):
        self._record = record
        self._inside = threading.local()
        self._libs: list = []

    def _kernel(self, op, spec):
        after = torch._C._after_ADInplaceOrView_keyset

        def kernel(keyset, *args, **kwargs):
            if getattr(self._inside, "op", None) is not None:
                return op.redispatch(keyset & after, *args, **kwargs)
            self._record(spec, op, args)
            self._inside.op = op
            try:
                return op.redispatch(keyset & after, *args, **kwargs)
            finally:
                self._inside.op = None

        return kernel

    def __enter__(self):
        libs = {}
        for op, spec in COLLECTIVES.items():
            if op.namespace not in libs:
                libs[op.namespace] = torch.library.Library(op.namespace, "IMPL")
            name = op._schema.name.split("::")[1]
            name += "" if op._overloadname == "default" else f".{op._overloadname}"
            libs[op.namespace].impl(name, self._kernel(op, spec), "ADInplaceOrView", with_keyset=True)
        self._libs = list(libs.values())
        return self

    def __exit__(self, *exc):
        for lib in self._libs:
            lib._destroy()
        self._libs = []
        return False
