"""A CPU twin of NCCL's ordering rules for the gloo test ranks (on in `tests.spawn.run_on_ranks`).

gloo matches point-to-point messages whatever order the two ranks post them in, and takes
collectives that differ between ranks as long as the bytes agree; NCCL hangs (or mixes data).
Inside `NcclTwin`, on every group except those made with ``new_group(..., backend="gloo")``
(host groups, gloo also on a GPU machine: the data loaders'):

* point-to-point (``dist.isend``/``irecv``; in torch 2.13 ``send``/``recv`` are built on them,
  so the originals in ``distributed_c10d`` are wrapped) behaves as NCCL's two-rank
  communicators: a pair's first operation blocks until the peer has posted its first operation
  to this rank (NCCL creates the pair's communicator then, both ranks together), and a pair's
  operations run in posting order on one stream, so rank a's k-th operation towards b must be
  the send (receive) matching b's k-th operation towards a, same shape and dtype. A ``wait`` (and
  the exit, for operations never waited for) checks every operation of the pair up to the waited
  one: two receives, or two sends, facing each other fail at once as a deadlock naming both; a
  peer that never posts its k-th operation fails after ``timeout_s``, naming what is pending.
  (Two facing sends are taken as a deadlock: NCCL completes them only while they fit its buffers.)
* the collectives called through ``torch.distributed`` are logged per group (op, dtype, and the
  shapes where NCCL needs them equal); at exit each rank compares its log with every other
  member's and fails at the first difference. DTensor's own collectives (functional
  collectives) are not seen.
* ``batch_isend_irecv`` is refused: the project does not use it and its group semantics are not
  modelled here.

Messages between the ranks' twins go through the default store. Off with ``RAY_DHP_NCCL_TWIN=0``
(``tests/spawn.py``), e.g. to time the suite without it.
"""

from __future__ import annotations

import os
import pickle
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

TIMEOUT_ENV = "RAY_DHP_NCCL_TWIN_TIMEOUT_S"
_COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
                "reduce_scatter_tensor", "all_to_all_single", "all_to_all", "barrier")
_VARIABLE_SHAPES = ("all_to_all_single", "all_to_all")  # splits may differ between ranks


def _tensors(obj):
    if isinstance(obj, (list, tuple)):
        return [t for o in obj for t in _tensors(o)]
    return [obj] if hasattr(obj, "shape") and hasattr(obj, "dtype") else []


def _desc(op, args) -> tuple:
    ts = _tensors(args)
    shapes = None if op in _VARIABLE_SHAPES else tuple(tuple(t.shape) for t in ts)
    return (op, tuple(sorted({str(t.dtype) for t in ts})), shapes)


class _Work:
    """A point-to-point work whose ``wait`` first checks the pair's order under NCCL's rules."""

    def __init__(self, twin, work, key, index):
        self._twin, self._work, self._key, self._index = twin, work, key, index

    def wait(self, *args, **kwargs):
        self._twin.check(self._key, self._index)
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._work, name)


class NcclTwin:
    """Context manager: NCCL's point-to-point and collective ordering rules on gloo (see above)."""

    def __init__(self, timeout_s: float | None = None):
        self.timeout = timedelta(seconds=float(timeout_s or os.environ.get(TIMEOUT_ENV, 300)))
        self.rank = dist.get_rank()
        self.store = c10d.PrefixStore("nccl_twin/", c10d._get_default_store())
        self.posted: dict = {}    # (group name, peer) -> [(kind, shape, dtype)] in posting order
        self.checked: dict = {}   # (group name, peer) -> how many of them are checked
        self.log: list = []       # (group name, members, collective descriptor)
        self.host_groups: set = set()
        self._saved: list = []

    # -- point-to-point ---------------------------------------------------------------------------

    def _wait_key(self, key: str, what: str) -> bytes:
        try:
            self.store.wait([key], self.timeout)
        except Exception:  # noqa: BLE001 - the store's timeout error
            raise AssertionError(f"NCCL twin: rank {self.rank} waited {self.timeout.seconds} s for "
                                 f"{what}; pending here: {self._pending()}") from None
        return self.store.get(key)

    def _pending(self) -> str:
        return "; ".join(f"group {g} peer {p}: {ops[self.checked.get((g, p), 0):]}"
                         for (g, p), ops in self.posted.items()
                         if len(ops) > self.checked.get((g, p), 0)) or "nothing"

    def _post(self, kind, fn, tensor, peer, group, kwargs):
        pg = group if group is not None else c10d._get_default_group()
        if pg.group_name in self.host_groups:
            return fn(tensor, peer, group, **kwargs)
        local = kwargs.get("group_dst", kwargs.get("group_src"))
        if local is not None:  # the peer given as a group rank
            peer = dist.get_global_rank(pg, local)
        elif peer is None:
            raise AssertionError("NCCL twin: a receive from any source (src=None) has no NCCL equivalent")
        call_peer = None if local is not None else peer
        key, desc = (pg.group_name, int(peer)), (kind, tuple(tensor.shape), str(tensor.dtype))
        ops = self.posted.setdefault(key, [])
        self.store.set(f"p2p/{key[0]}/{self.rank}>{peer}/{len(ops)}", pickle.dumps(desc))
        if not ops:  # NCCL creates the pair's communicator at its first operation, both together
            self.store.set(f"init/{key[0]}/{self.rank}>{peer}", b"1")
            self._wait_key(f"init/{key[0]}/{peer}>{self.rank}",
                           f"rank {peer} to create its communicator with rank {self.rank} on group "
                           f"{key[0]} (my first operation with it: {desc}); pair communicators must "
                           f"be created in an order that cannot wait in a cycle")
        ops.append(desc)
        return _Work(self, fn(tensor, call_peer, group, **kwargs), key, len(ops) - 1)

    def check(self, key, upto: int) -> None:
        """Rank ``self.rank``'s operations 0..upto with the peer must face their matches."""
        group, peer = key
        ops = self.posted[key]
        for j in range(self.checked.get(key, 0), upto + 1):
            theirs = pickle.loads(self._wait_key(
                f"p2p/{group}/{peer}>{self.rank}/{j}",
                f"rank {peer}'s point-to-point operation #{j} with it on group {group} (to match "
                f"{ops[j]})"))
            mine = ops[j]
            if mine[0] == theirs[0] or mine[1:] != theirs[1:]:
                raise AssertionError(
                    f"NCCL twin: deadlock or mismatch on group {group}: rank {self.rank}'s "
                    f"point-to-point operation #{j} with rank {peer} is {mine[0]} {mine[1:]}, rank "
                    f"{peer}'s #{j} with rank {self.rank} is {theirs[0]} {theirs[1:]}. NCCL runs a "
                    f"pair's operations in posting order on one stream, so the k-th operations of "
                    f"the two ranks must be a send and its matching receive. Rank {self.rank} "
                    f"posted towards {peer}: {ops}")
            self.checked[key] = j + 1

    # -- collectives ------------------------------------------------------------------------------

    def _collective(self, op, fn):
        def wrapped(*args, **kwargs):
            pg = kwargs.get("group") or next((a for a in args if isinstance(a, dist.ProcessGroup)), None)
            pg = pg if pg is not None else c10d._get_default_group()
            if pg.group_name not in self.host_groups:
                self.log.append((pg.group_name, tuple(dist.get_process_group_ranks(pg)), _desc(op, args)))
            return fn(*args, **kwargs)
        return wrapped

    def _compare_collectives(self) -> None:
        self.store.set(f"coll/{self.rank}", pickle.dumps(self.log))
        mine: dict = {}
        for group, members, desc in self.log:
            mine.setdefault((group, members), []).append(desc)
        for (group, members), seq in mine.items():
            for other in members:
                if other == self.rank:
                    continue
                log = pickle.loads(self._wait_key(f"coll/{other}", f"rank {other}'s collective log"))
                theirs = [d for g, _, d in log if g == group]
                for i, (a, b) in enumerate(zip(seq + [None] * len(theirs), theirs + [None] * len(seq))):
                    if a != b:
                        raise AssertionError(
                            f"NCCL twin: collective #{i} on group {group} {members} differs: rank "
                            f"{self.rank} called {a}, rank {other} called {b} (NCCL needs the same "
                            f"collectives in the same order, same shapes, on every member)")

    # -- the context ------------------------------------------------------------------------------

    def _patch(self, module, name, fn):
        self._saved.append((module, name, getattr(module, name)))
        setattr(module, name, fn)

    def __enter__(self):
        isend, irecv, new_group = c10d.isend, c10d.irecv, dist.new_group

        def twin_isend(tensor, dst=None, group=None, tag=0, **kw):
            return self._post("send", isend, tensor, dst, group, dict(tag=tag, **kw))

        def twin_irecv(tensor, src=None, group=None, tag=0, **kw):
            return self._post("recv", irecv, tensor, src, group, dict(tag=tag, **kw))

        def twin_new_group(*args, **kwargs):
            pg = new_group(*args, **kwargs)
            if kwargs.get("backend") == "gloo" and isinstance(pg, dist.ProcessGroup):
                self.host_groups.add(pg.group_name)
            return pg

        def refuse(*args, **kwargs):
            raise AssertionError("NCCL twin: batch_isend_irecv is not modelled (NCCL group semantics)")

        for module in (dist, c10d):
            self._patch(module, "isend", twin_isend)
            self._patch(module, "irecv", twin_irecv)
        self._patch(dist, "new_group", twin_new_group)
        self._patch(dist, "batch_isend_irecv", refuse)
        for op in _COLLECTIVES:
            self._patch(dist, op, self._collective(op, getattr(dist, op)))
        return self

    def __exit__(self, exc_type, *exc):
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
        if exc_type is None:
            for key, ops in self.posted.items():
                self.check(key, len(ops) - 1)  # also the sends nobody waited for
            self._compare_collectives()
        return False


def run_under_twin(rank, world_size, fn, args, timeout_s=None):
    """``fn(rank, world_size, *args)`` inside `NcclTwin` (the body `tests.spawn` spawns)."""
    with NcclTwin(timeout_s):
        return fn(rank, world_size, *args)
