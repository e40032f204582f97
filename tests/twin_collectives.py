"""Every collective a rank issues, seen where torch dispatches it (the NCCL twin's collective log).

Our own collectives (``dist.all_reduce`` ...), DTensor's (TP redistributes, ``loss_parallel``,
``full_tensor``: functional collectives, ``torch.ops._c10d_functional.*``) and FSDP2's
all-gathers / reduce-scatters (``dist.all_gather_single`` / ``reduce_scatter_single``, i.e.
``torch.ops.c10d._allgather_base_`` / ``_reduce_scatter_base_``) all reach the dispatcher as one
of the ops in `COLLECTIVES`. `CollectiveLog` is a ``TorchDispatchMode`` that hands each of them to
a callback with what NCCL needs equal on every member: the op (one name per NCCL operation,
whichever API issued it), dtypes, shapes (not for the all-to-alls, whose splits may differ) and
the root of a rooted op; and, for the error messages only, the op as dispatched, the torch frame
that issued it (``via``: FSDP2's or DTensor's code) and the project frame above it (``site``).

A mode sees an op once: the c10d op a functional collective runs inside its kernel is not seen
again. DTensor ops are handed back to DTensor (``NotImplemented``, as torch's ``CommDebugMode``
does) so that its collectives reach the mode as plain-tensor ops. A mode is per thread: the
collectives of another thread (the checkpoint writer's, on its own gloo group) are not seen.
"""

from __future__ import annotations

import os
import sys
from typing import NamedTuple

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

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
    by_name: bool         # the group is given by name (functional collectives)
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
    return Spec(name, group, args[group] == "group_name", None if name in _VARIABLE else payload, root)


def _collectives() -> dict:
    out = {}
    for ns in ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor"):
        for qualified in torch._C._dispatch_get_all_op_names():
            if not qualified.startswith(ns + "::"):
                continue
            packet = getattr(getattr(torch.ops, ns), qualified.split("::")[1].split(".")[0])
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


class CollectiveLog(TorchDispatchMode):
    """Calls ``record(spec, op, args)`` before each collective in `COLLECTIVES` runs."""

    def __init__(self, record):
        super().__init__()
        self._record = record

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if DTensor in types:  # let DTensor lower it: its collectives come back as plain ops
            return NotImplemented
        spec = COLLECTIVES.get(func)
        if spec is not None:
            self._record(spec, func, args)
        return func(*args, **(kwargs or {}))
