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
* every collective is logged per group where torch dispatches it (`tests.twin_collectives`: a
  kernel of ours on the ``c10d`` and functional-collective ops), so ours (``dist.*``),
  DTensor's (TP/SP redistributes, ``loss_parallel``, ``full_tensor``) and FSDP2's all-gathers
  and reduce-scatters alike: the NCCL operation, dtypes, the shapes where NCCL needs them equal
  and the root, plus (for the messages) the op as dispatched, the torch.distributed frame that
  issued it and the frame above it. Each collective is published in the store and compared,
  before it runs, with what the members that got to the same position on its group issued
  there (each member appends to that position's record, then reads it back, so of two members
  issuing different collectives the later one fails, before gloo takes the mismatch or crashes
  on it). At exit each rank compares its whole log with every member's (a member that never
  reached a position, e.g. one collective issued by one rank only at the end, fails there) and
  fails at the first difference, naming both collectives and printing both ranks' lists around
  it. When a body fails, what the peers published is compared once, so a mismatch gloo took
  is named. Host groups are not logged.
* ``batch_isend_irecv`` is refused: the project does not use it and its group semantics are not
  modelled here.

Messages between the ranks' twins go through the default store. Off with ``RAY_DHP_NCCL_TWIN=0``
(``tests/spawn.py``), e.g. to time the suite without it.
"""

from __future__ import annotations

import os
import pickle
import struct
import time
from datetime import timedelta

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from tests.twin_collectives import CollectiveLog, call_site, describe

TIMEOUT_ENV = "RAY_DHP_NCCL_TWIN_TIMEOUT_S"


def _entry(entry) -> str:
    """A logged collective for the messages: op, dtypes, shapes, root; then how it was issued."""
    (op, dtypes, shapes, root), source, via, site = entry
    what = f"{op} {'/'.join(d.removeprefix('torch.') for d in dtypes)} {shapes}"
    what += f" root {root}" if root is not None else ""
    return what + f" [{source}" + (f" via {via}" if via else "") + f" at {site}]"


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
        self.log: dict = {}       # group name -> [(descriptor, op as dispatched, via, site)]
        self.members: dict = {}   # group name -> its global ranks
        self._collectives = CollectiveLog(self._record)
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

    def _record(self, spec, op, args) -> None:
        """`CollectiveLog`'s callback, before the collective runs: log it, publish it, and compare
        it with what the members that reached the same position on the group issued there.
        Each member appends to the position's record, then reads it: of two members that issue
        different collectives, the later one sees the earlier one's and fails before gloo can
        take (or crash on) the mismatch; a member that never gets there is compared at exit."""
        group = args[spec.group]
        if isinstance(group, str):  # functional collectives name it
            pg = c10d._resolve_process_group(group)
        else:
            pg = group if isinstance(group, dist.ProcessGroup) else dist.ProcessGroup.unbox(group)
        name = pg.group_name
        if name in self.host_groups or dist.get_backend(pg) == "fake":  # fake: nothing is sent
            return
        if name not in self.members:
            self.members[name] = tuple(dist.get_process_group_ranks(pg))
        seq = self.log.setdefault(name, [])
        k, entry = len(seq), (describe(spec, args), str(op).removesuffix(".default"), *call_site())
        self.store.set(f"c/{name}/{self.rank}/{k}", pickle.dumps(entry))
        seq.append(entry)
        if len(self.members[name]) == 1:
            return
        mine = pickle.dumps((self.rank, entry[0]))
        self.store.append(f"at/{name}/{k}", struct.pack("<I", len(mine)) + mine)
        arrived, pos = self.store.get(f"at/{name}/{k}"), 0
        while pos < len(arrived):
            (size,) = struct.unpack_from("<I", arrived, pos)
            peer, desc = pickle.loads(arrived[pos + 4:pos + 4 + size])
            pos += 4 + size
            if desc != entry[0]:
                raise AssertionError(self._diagnosis(name, self.members[name], k, peer, seq,
                                                     self._published(name, peer, 0), False))

    def _my_groups(self) -> dict:
        """Every group this rank is a member of (logged or not), but the host groups: name -> ranks."""
        out = dict(self.members)
        for pg, name in list(c10d._world.pg_names.items()):
            if name not in out and name not in self.host_groups and self.rank in c10d._world.pg_group_ranks.get(pg, {}):
                out[name] = tuple(dist.get_process_group_ranks(pg))
        return out

    def _published(self, group, peer, start) -> list:
        """The entries ``peer`` has published on ``group`` from #``start`` on (it may still run)."""
        out = []
        while self.store.check([f"c/{group}/{peer}/{start + len(out)}"]):
            out.append(pickle.loads(self.store.get(f"c/{group}/{peer}/{start + len(out)}")))
        return out

    def _compare_collectives(self, failed: bool) -> None:
        """Every member of every group must have issued the same collectives there: against a
        peer's whole log once it has finished; before that, against what it has published so
        far (a difference there, or an operation beyond this rank's last, fails already). A
        rank that failed is compared up to its last collective only, and, when this rank
        failed, in one pass without waiting."""
        groups = self._my_groups()
        peers = sorted({m for ranks in groups.values() for m in ranks if m != self.rank})
        start = time.monotonic()
        deadline = start + self.timeout.total_seconds()
        seen = {}  # (group, peer) -> the peer's published entries read so far
        while peers:
            for peer in list(peers):
                shared = [g for g, ranks in groups.items() if peer in ranks]
                if self.store.check([f"coll/{peer}"]):
                    peer_failed, theirs = pickle.loads(self.store.get(f"coll/{peer}"))
                    for g in shared:
                        self._diff(g, groups[g], peer, theirs.get(g, []), "prefix" if failed or peer_failed
                                   else "whole")
                    peers.remove(peer)
                    continue
                if not failed and time.monotonic() < start + 2:  # most peers finish meanwhile
                    continue
                for g in shared:
                    got = seen.setdefault((g, peer), [])
                    got += self._published(g, peer, len(got))
                    self._diff(g, groups[g], peer, got, "prefix" if failed else "published")
            if failed or not peers:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"NCCL twin: rank {self.rank} waited {self.timeout.seconds} s for the collective "
                    f"logs of rank(s) {peers} (still running: a hang, or a collective they never "
                    f"issued?); this rank's collectives: {self._counts()}")
            time.sleep(0.05)

    def _counts(self) -> str:
        return ", ".join(f"{len(seq)} on group {g}" for g, seq in self.log.items()) or "none"

    def _diff(self, group, members, peer, theirs, scope) -> None:
        """``scope``: "whole" (both logs complete), "published" (mine complete, theirs so far),
        "prefix" (as far as both go: one of us failed)."""
        mine = self.log.get(group, [])
        n = {"whole": max(len(mine), len(theirs)), "published": len(theirs),
             "prefix": min(len(mine), len(theirs))}[scope]
        for i in range(n):
            a = mine[i][0] if i < len(mine) else None
            b = theirs[i][0] if i < len(theirs) else None
            if a != b:
                raise AssertionError(self._diagnosis(group, members, i, peer, mine, theirs, scope == "whole"))

    def _diagnosis(self, group, members, i, peer, mine, theirs, complete) -> str:
        def at(seq, j):
            return _entry(seq[j]) if j < len(seq) else "nothing"

        lines = [f"NCCL twin: collective #{i} on group {group} {list(members)} differs: rank "
                 f"{self.rank} issued {at(mine, i)}; rank {peer} issued {at(theirs, i)}. NCCL needs "
                 f"the same collectives in the same order, same shapes and dtypes, on every member "
                 f"(it hangs or mixes data otherwise)."]
        for who, seq, whole in ((self.rank, mine, True), (peer, theirs, complete)):
            lo, hi = max(0, i - 6), min(len(seq), i + 4)
            lines.append(f"rank {who}'s collectives on group {group} (#{lo}-#{hi - 1} of {len(seq)}"
                         f"{'' if whole else ' published so far'}):")
            lines += [f"  #{j} {_entry(seq[j])}" for j in range(lo, hi)]
        return "\n".join(lines)

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
        self._collectives.__enter__()
        global _ACTIVE
        _ACTIVE = self
        return self

    def __exit__(self, exc_type, exc, tb):
        global _ACTIVE
        _ACTIVE = None
        self._collectives.__exit__(None, None, None)
        for module, name, fn in reversed(self._saved):
            setattr(module, name, fn)
        self._saved.clear()
        if exc_type is not None:  # the body's own error stands, unless the logs name a mismatch
            if issubclass(exc_type, Exception) and not str(exc).startswith("NCCL twin:"):
                try:  # a collective gloo took although it differed (a rank failed after): say which
                    self.store.set(f"coll/{self.rank}", pickle.dumps((True, self.log)))
                    self._compare_collectives(failed=True)
                    self.store.set(f"done/{self.rank}", b"1")
                except AssertionError as diagnosis:
                    raise diagnosis from exc
                except Exception:  # noqa: BLE001 - e.g. the store is gone with a failed rank 0
                    pass
            return False
        self.store.set(f"coll/{self.rank}", pickle.dumps((False, self.log)))
        for key, ops in self.posted.items():
            self.check(key, len(ops) - 1)  # also the sends nobody waited for
        self._compare_collectives(failed=False)
        self.store.set(f"done/{self.rank}", b"1")
        if self.rank == 0:  # the store lives in rank 0's process: keep it until every rank has
            try:  # read what it needs from it
                self.store.wait([f"done/{r}" for r in range(dist.get_world_size())], self.timeout)
            except Exception:  # noqa: BLE001 - a rank that hangs or died is reported by its own error
                pass
        return False


_ACTIVE: NcclTwin | None = None


def active() -> NcclTwin | None:
    """The twin this rank runs under (None with ``RAY_DHP_NCCL_TWIN=0``): tests read its log."""
    return _ACTIVE


def run_under_twin(rank, world_size, fn, args, timeout_s=None):
    """``fn(rank, world_size, *args)`` inside `NcclTwin` (the body `tests.spawn` spawns)."""
    with NcclTwin(timeout_s):
        return fn(rank, world_size, *args)
