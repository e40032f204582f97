"""Row reads of a row-sharded table outside its embedding, served as a vocabulary-parallel lookup.

Some stock forwards read a row of the input-embedding table directly (``table.weight[i, :]``,
e.g. a pad row) besides calling the embedding. Under text TP (a vocabulary-parallel embedding) or
ZeRO-3 the table is a ``Shard(0)`` DTensor, and DTensor serves ``select`` on the sharded dim by
all-gathering the *whole* table on every rank (each rank materialising what it does not keep).
`ShardedRowReads` serves such a read as the embedding op DTensor already shards: each rank looks
the row up in its own slice (``MaskPartial``: zeros where it is not the owner) and one all-reduce
of the row's ``[hidden]`` sums them — the same value, bit for bit (one non-zero term).

* forward: masked local lookup + all-reduce of one row (on the table's mesh);
* backward: the lookup's adjoint (the row's gradient to the owner's slice), as DTensor's
  embedding backward gives it.

Every rank of the table's mesh runs the same forward, so the all-reduce comes in the same order
on every rank (valid under NCCL). Reads of anything else (a plain tensor, a table sharded on
another dim, an index that is not one integer row) pass through untouched.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["ShardedRowReads"]


class ShardedRowReads(TorchFunctionMode):
    """While active, ``t[i]`` / ``t[i, :]`` of a 2-D DTensor sharded on dim 0 (and on no other
    dim) returns row ``i`` as a plain tensor by a vocabulary-parallel lookup (module docstring)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.__getitem__ and len(args) == 2:
            row = _row_index(*args)
            if row is not None:
                return _lookup(args[0], row)
        return func(*args, **kwargs)


def _row_index(table, index):
    """The integer row of ``table[index]`` where ``table`` is a row-sharded 2-D DTensor and
    ``index`` one integer (alone or with a whole-row slice), else None."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(table, DTensor) or table.dim() != 2:
        return None
    if not any(isinstance(p, Shard) and p.dim == 0 for p in table.placements) or \
            any(isinstance(p, Shard) and p.dim != 0 for p in table.placements):
        return None
    if isinstance(index, tuple):
        if len(index) != 2 or index[1] != slice(None):
            return None
        index = index[0]
    if isinstance(index, bool) or not isinstance(index, int):
        return None
    return index + table.shape[0] if index < 0 else index


def _lookup(table, row: int) -> torch.Tensor:
    from torch.distributed.tensor import DTensor, Replicate

    ids = torch.tensor([row], device=table.to_local().device)
    ids = DTensor.from_local(ids, table.device_mesh, [Replicate()] * table.device_mesh.ndim,
                             run_check=False)
    return torch.nn.functional.embedding(ids, table).full_tensor()[0]
