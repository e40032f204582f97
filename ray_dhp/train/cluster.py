"""Driver-side checks against the Ray cluster a run is about to use (multi-node rules).

Everything here runs in the driver, in ``DisaggregatedTrainer.fit()``, before the controller
starts: it reads the alive nodes (``ray.nodes()``) and says, once, what will go wrong on them:

* checkpoint storage that is a local directory while the cluster has more than one node (Ray
  does not sync local directories between nodes: each node would hold some ranks' shards);
* node labels per placement group (``DHPConfig(labels=...)``) that fewer alive nodes carry than
  the group needs: a `ray_dhp.train.labels.LabelRefusal` naming the label and the counts;
* a placement strategy that scatters workers (``SPREAD``), which puts sp/tp groups across nodes;
* a layout whose sp/tp groups cannot be node-local on these nodes (no node has room for a whole
  group, or the nodes' sizes cannot be cut into whole groups): a warning, or with
  ``DHPConfig(node_local="strict")`` a ``ValueError`` before any worker starts.

The actual placement is checked again by the backend once the workers exist
(`ray_dhp.train.backend.DisaggregatedBackend.on_start`). Also here: the bound on how long a run waits
for a placement that cannot be satisfied (`bound_placement_retries`).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import replace
from typing import Optional

from ray_dhp.train.labels import worker_room

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_PLACEMENT_TIMEOUT_S", "preflight", "is_shared_storage", "node_capacities",
           "bound_placement_retries", "start_timeout_s", "PlacementTimeoutError"]

DEFAULT_PLACEMENT_TIMEOUT_S = 600.0
_START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train V2, default 60 s
_NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph",
               "cephfs", "glusterfs", "fuse.glusterfs", "fuse.s3fs", "fuse.gcsfuse",
               "fuse.juicefs", "fuse.goofys", "fuse.mountpoint-s3", "9p", "virtiofs", "wekafs",
               "panfs", "afs", "fuse.sshfs")


class PlacementTimeoutError(RuntimeError):
    """The worker group could not be placed within ``placement_timeout_s`` (a node was lost and
    not replaced, or the cluster is too small for the layout)."""


def start_timeout_s() -> float:
    """Ray Train's wait for one placement (``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``, 60 s)."""
    return float(os.environ.get(_START_TIMEOUT_ENV, 60.0))


def bound_placement_retries(failure_config, placement_timeout_s: Optional[float]):
    """``failure_config`` with a finite ``controller_failure_limit`` so that an unsatisfiable
    placement fails the run after about ``placement_timeout_s`` instead of retrying forever.

    Ray Train retries a placement that timed out (``WorkerGroupStartupTimeoutError``, one per
    ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``) as a controller failure, and
    ``controller_failure_limit`` defaults to -1 (unlimited): a run that lost a node and gets no
    replacement would wait forever. With ``ceil(placement_timeout_s / start timeout)`` attempts
    the wait is bounded by ``placement_timeout_s`` rounded up to a whole start timeout. The
    limit counts over the whole run. Left alone when the user set a limit or passed None.
    """
    import ray.train

    fc = failure_config or ray.train.FailureConfig()
    if placement_timeout_s is None or fc.controller_failure_limit != -1:
        return fc
    attempts = max(1, math.ceil(placement_timeout_s / start_timeout_s()))
    return replace(fc, controller_failure_limit=attempts - 1)


def is_shared_storage(path: Optional[str]) -> bool:
    """True for a URI (``s3://``, ``gs://``...; not ``file://``) or a directory on a network file
    system (NFS, Lustre, CephFS, FUSE object-store mounts...: ``/proc/mounts``)."""
    if not path:
        return False  # Ray's default, ~/ray_results: local
    if "://" in path:
        return not path.startswith("file://")
    try:
        with open("/proc/mounts") as f:
            mounts = [line.split()[1:3] for line in f if len(line.split()) >= 3]
    except OSError:
        return False
    real = os.path.realpath(os.path.expanduser(path))
    best = max((m for m in mounts if real == m[0] or real.startswith(m[0].rstrip("/") + "/")),
               key=lambda m: len(m[0]), default=None)
    return best is not None and (best[1] in _NETWORK_FS or best[1].startswith("fuse."))


def node_capacities(nodes: list, per_worker: dict) -> dict:
    """``{node label: workers of `per_worker` it can hold}`` from ``ray.nodes()`` totals."""
    out = {}
    for n in nodes:
        cap = worker_room(n.get("Resources", {}), per_worker)
        if cap > 0:
            out[f"{n.get('NodeManagerAddress')}/{n.get('NodeID', '')[:8]}"] = cap
    return out


def _storage_warning(storage_path: Optional[str], num_nodes: int) -> Optional[str]:
    if num_nodes <= 1 or is_shared_storage(storage_path):
        return None
    return (f"ray_dhp: the cluster has {num_nodes} nodes but the checkpoint storage "
            f"RunConfig(storage_path={storage_path!r}) (run.storage_path) is a local directory. "
            "Ray does not sync local directories between nodes: each node would keep only its "
            "own ranks' checkpoint shards, and a restart on another node cannot resume. Use a "
            "shared file system (NFS, ...) mounted at the same path on every node, or a URI "
            "such as s3://bucket/path.")


def _layout_forced_apart(topology, caps: dict) -> list:
    """The sp/tp groups that cross nodes in the best assignment on nodes of sizes ``caps``
    (filled largest first, as PACK does on an idle cluster); empty when all can be local."""
    from ray_dhp.parallel.nodes import crossing_groups, node_local_order, nodes_by_rank

    slots = [n for n, c in sorted(caps.items(), key=lambda kv: -kv[1]) for _ in range(c)]
    if len(slots) < topology.world_size:
        return []  # the cluster cannot hold the layout at all: Ray Train waits (bounded)
    slots = slots[:topology.world_size]
    order = node_local_order(topology, slots)
    return crossing_groups(topology, nodes_by_rank(order, slots))


def preflight(dhp_config, scaling_config, run_config) -> list:
    """Check the layout and run config against the alive nodes; log each problem once (a
    warning) and return the messages. ValueError for what ``node_local="strict"`` forbids."""
    import ray

    if not ray.is_initialized():
        ray.init()  # what fit() would do anyway
    nodes = [n for n in ray.nodes() if n.get("Alive")]
    if dhp_config.labels:  # fewer labelled nodes than a group needs: refused, not waited for
        from ray_dhp.train.labels import check_labelled_nodes

        check_labelled_nodes(dhp_config.topology(), dhp_config.labels, nodes,
                             scaling_config._resources_per_worker_not_none)
    messages = []
    if (m := _storage_warning(run_config.storage_path, len(nodes))) is not None:
        messages.append(m)
    topo, strict = dhp_config.topology(), dhp_config.node_local == "strict"
    chatty = max(m.inner for m in topo.modules) > 1
    strategy = scaling_config.placement_strategy
    if chatty and len(nodes) > 1 and strategy in ("SPREAD", "STRICT_SPREAD"):
        m = (f"ray_dhp: ScalingConfig(placement_strategy={strategy!r}) spreads the workers over "
             "nodes, so sequence/tensor-parallel groups land across node boundaries; use 'PACK' "
             "(the default), which fills nodes with consecutive ranks.")
        if strict:
            raise ValueError(m + " (placement.node_local=strict)")
        messages.append(m)
    caps = node_capacities(nodes, scaling_config._resources_per_worker_not_none)
    # with labels, each group has its own nodes: the backend checks the groups it got
    forced = (_layout_forced_apart(topo, caps) if chatty and len(caps) > 1
              and not dhp_config.labels else [])
    if forced:
        groups = "; ".join(f"{label} needs {len(ranks)} workers on one node"
                           for label, ranks, _ in forced)
        m = (f"ray_dhp: this layout cannot keep its sequence/tensor-parallel groups inside a "
             f"node on this cluster: {groups}, but the nodes hold {dict(caps)} workers of "
             f"{scaling_config._resources_per_worker_not_none} each. Their per-block collectives "
             "will cross the network. Lower the degree, or give the nodes room for whole groups.")
        if strict:
            raise ValueError(m + " (placement.node_local=strict forbids it)")
        messages.append(m)
    for m in messages:
        logger.warning(m)
    return messages
