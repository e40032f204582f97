"""The Ray Train backend: one torch.distributed world and the module groups, on every worker.

Ray Train V2 runs `Backend` hooks in the controller actor. A plain exception in ``on_start`` is a
non-retryable controller error that leaks the worker group (Ray 2.60), so ``on_start`` only does
cheap, bounded work: it reads which node every worker landed on (and, with node labels per
placement group, which placement-group bundle it was placed for), orders the DHP ranks so that the
sp/tp groups stay inside a node (`ray_dhp.parallel.nodes.node_local_order`), warns about any group the
placement forces across nodes, picks the rendezvous address (the worker of DHP rank 0, wherever
it is) and exports rank and address to the workers.
Everything that can fail — ``init_process_group``, ``new_group``, the meshes — happens in
`WorkerContextManager`, which Ray Train enters on each worker around the train function, so a
failure there takes Ray Train's normal retry path (``FailureConfig``) with nothing leaked.
"""

from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from ray.train.backend import Backend

from ray_dhp.train.launch import free_port

logger = logging.getLogger(__name__)

_ENV_ADDR, _ENV_PORT = "RAY_DHP_MASTER_ADDR", "RAY_DHP_MASTER_PORT"
_ENV_RANK, _ENV_REFUSE = "RAY_DHP_RANK", "RAY_DHP_PLACEMENT_ERROR"
_CURRENT: Optional["DHPContext"] = None


class DHPContext:
    """What the train function gets from the backend: config, topology, groups, device."""

    def __init__(self, dhp_config, groups):
        self.dhp_config = dhp_config
        self.groups = groups
        self.topology = groups.topology
        self.device = groups.device
        self.rank = groups.rank

    @property
    def roles(self) -> tuple:
        return self.topology.roles(self.rank)


def get_context() -> DHPContext:
    """The DHP context of this worker (inside a `DisaggregatedTrainer` train function)."""
    if _CURRENT is None:
        raise RuntimeError(
            "ray_dhp.get_context() is only available inside the train function of a "
            "DisaggregatedTrainer (or a WorkerContextManager block)."
        )
    return _CURRENT


def _set_rendezvous(addr: str, port: int, rank: int, refuse: str = "") -> None:
    os.environ[_ENV_ADDR], os.environ[_ENV_PORT] = addr, str(port)
    os.environ[_ENV_RANK] = str(rank)
    os.environ[_ENV_REFUSE] = refuse


def node_label(metadata) -> str:
    """A worker's node as people read it: ``ip/node-id-prefix`` (local clusters share an ip)."""
    return f"{metadata.node_ip}/{metadata.node_id[:8]}"


def crossing_warning(crossing: list, node_sizes: dict, labelled: bool = False) -> str:
    """The driver-facing text for sp/tp groups that span nodes (empty when there are none);
    ``labelled``: each placement group was kept on the nodes its labels selected."""
    if not crossing:
        return ""
    groups = "; ".join(f"{label} (ranks {ranks}) spans nodes {', '.join(map(str, nodes))}"
                       for label, ranks, nodes in crossing)
    sizes = ", ".join(f"{n}: {k}" for n, k in node_sizes.items())
    return (f"ray_dhp: {len(crossing)} sequence/tensor-parallel group(s) cross a node boundary, "
            f"so their per-block all-to-all / all-reduce goes over the network: {groups}. Why: "
            f"the placement put workers on nodes as {{{sizes}}}, and no node-local assignment of "
            f"whole groups exists for these sizes"
            + (" within each placement group's labelled nodes" if labelled else "")
            + ". Make every node hold a multiple of the group "
            "size (resources per worker, GPUs per node) or change the degrees; "
            "placement.node_local=strict turns this into an error.")


def _teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class DisaggregatedBackend(Backend):
    share_cuda_visible_devices = True

    def on_start(self, worker_group, backend_config) -> None:
        import ray
        from ray.train._internal.utils import get_address_and_port

        from ray_dhp.parallel.nodes import crossing_groups, node_local_order, nodes_by_rank

        backend_config.validate_workers(len(worker_group))
        topo = backend_config.topology()
        workers = worker_group.get_workers()  # by world rank
        nodes = [node_label(w.metadata) for w in workers]
        # With labels, bundle r was placed on a node fit for DHP rank r's placement group, and Ray
        # Train numbered the workers by node, not by bundle: keep each in its bundle's group.
        bundles = [getattr(w, "placement_group_bundle_index", None) for w in workers]
        pinned = bool(backend_config.labels) and None not in bundles
        if backend_config.labels and not pinned:
            logger.warning("ray_dhp: the workers' placement-group bundles are unknown; DHP ranks "
                           "follow Ray's world ranks, which may not match the labels' groups.")
        order = node_local_order(topo, nodes, bundles if pinned else None)
        node_of = nodes_by_rank(order, nodes)
        logger.info("ray_dhp: DHP ranks by node: %s", {
            n: [r for r in range(len(node_of)) if node_of[r] == n] for n in dict.fromkeys(nodes)})
        text = crossing_warning(crossing_groups(topo, node_of),
                                {n: nodes.count(n) for n in dict.fromkeys(nodes)}, pinned)
        refuse = text if text and getattr(backend_config, "node_local", "warn") == "strict" else ""
        if text and not refuse:
            logger.warning(text)
        addr, port = worker_group.execute_single(order.index(0), get_address_and_port)
        ray.get([worker_group.execute_single_async(w, _set_rendezvous, addr, port, order[w], refuse)
                 for w in range(len(order))])

    def on_shutdown(self, worker_group, backend_config) -> None:
        try:
            worker_group.execute(_teardown)
        except Exception as e:  # noqa: BLE001 - workers may already be gone before a restart
            logger.debug("teardown on shutdown failed: %s", e)


def world_backend(device: torch.device) -> str:
    """The default group's backend: NCCL for CUDA tensors with a gloo twin for CPU tensors on
    GPU workers (object collectives, checkpoint barriers, anything host-side stays valid; the
    training collectives themselves send tensors on the device), plain gloo on CPU."""
    return "cpu:gloo,cuda:nccl" if device.type == "cuda" else "gloo"


def _device() -> torch.device:
    if torch.cuda.is_available():
        import ray.train.torch

        dev = ray.train.torch.get_device()
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
            return dev
    return torch.device("cpu")


class WorkerContextManager:
    """Entered on every worker around the train function: world, groups, meshes; torn down after."""

    def __init__(self, dhp_config):
        self.cfg = dhp_config

    def __enter__(self):
        global _CURRENT
        from ray_dhp.parallel.mesh import build_groups

        import ray.train

        ctx = ray.train.get_context()
        if os.environ.get(_ENV_REFUSE):  # node_local=strict: fail here, on the retry path
            raise RuntimeError(os.environ[_ENV_REFUSE])
        # The DHP rank (node-local order, see on_start); Ray's world rank in local mode.
        rank = int(os.environ.get(_ENV_RANK, ctx.get_world_rank()))
        world = ctx.get_world_size()
        device = _device()
        if not dist.is_initialized():
            # Local mode (num_workers=0) runs no backend hooks: a 1-rank world on a free port.
            addr = os.environ.get(_ENV_ADDR, "127.0.0.1")
            port = os.environ.get(_ENV_PORT) or str(free_port())
            dist.init_process_group(
                world_backend(device),
                init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                timeout=timedelta(seconds=self.cfg.timeout_s),
            )
        _CURRENT = DHPContext(self.cfg, build_groups(self.cfg.topology(), device))
        if rank == 0:
            logger.debug("ray_dhp layout:\n%s", self.cfg.topology().describe())  # the CLI prints it once
        return _CURRENT

    def __exit__(self, *exc):
        global _CURRENT
        _CURRENT = None
        _teardown()
        return False

