"""`ShardedRowReads`: on 2 gloo ranks, fp64, a row read ``table[i, :]`` of a row-sharded DTensor
table (a vocabulary-parallel embedding's, ZeRO-3's) gives the unsharded table's row, bit for
bit, with one all-reduce of that row — where DTensor alone (the negative control) all-gathers
the whole table — and its gradient reaches only the owner's slice. Other reads pass through.
The model-level exactness is Gemma 4's rows of ``test_families.py``."""

from __future__ import annotations

import torch

from tests.spawn import run_on_ranks


def _body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.debug import CommDebugMode

    from ray_dhp.parallel.table_rows import ShardedRowReads

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    full = torch.randn(8, 4, dtype=torch.float64)
    table = torch.nn.Parameter(distribute_tensor(full.clone(), mesh, [Shard(0)]))
    with CommDebugMode() as ours, ShardedRowReads():
        row, last, plain = table[5, :], table[-1], full[2, 1:]
    with CommDebugMode() as dtensor:
        table[5, :]
    (row * torch.arange(4.0, dtype=torch.float64)).sum().backward()
    want = torch.zeros_like(full)
    want[5] = torch.arange(4.0)
    return {"rows": torch.equal(row, full[5]) and torch.equal(last, full[-1]),
            "plain": type(row) is torch.Tensor and torch.equal(plain, full[2, 1:]),
            "ours": {str(k): v for k, v in ours.get_comm_counts().items()},
            "dtensor": {str(k): v for k, v in dtensor.get_comm_counts().items()},
            "grad": torch.equal(table.grad.full_tensor(), want)}


def test_a_row_read_of_a_sharded_table_is_one_row_all_reduced():
    for r in run_on_ranks(_body, 2):
        assert r["rows"] and r["plain"] and r["grad"], r
        assert [k for k in r["ours"] if "all_gather" in k] == [] and \
            sum(v for k, v in r["ours"].items() if "all_reduce" in k) == 2, r
        assert any("all_gather" in k for k in r["dtensor"]), r  # what it replaces
