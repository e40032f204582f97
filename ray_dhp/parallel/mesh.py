"""Process groups and device meshes for one worker, built from a `Topology`.

Every rank calls ``new_group`` for every group in the same order (a torch.distributed rule), then
keeps the groups it belongs to. The text mesh is a 2-D ``DeviceMesh`` ``("dp", "tp")`` built from
those groups (``DeviceMesh.from_group``), so DTensor tensor parallelism runs on it; it is built only
on text ranks, which works for both placements.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from ray_dhp.parallel.topology import Topology


@dataclass
class EncoderGroups:
    """One encoder module's groups on a rank that hosts it."""

    sp: Optional[dist.ProcessGroup] = None    # my replica's SP ranks
    dp: Optional[dist.ProcessGroup] = None    # ranks holding my SP slice in other replicas
    all: Optional[dist.ProcessGroup] = None   # the whole encoder group
    mesh: Optional[object] = None             # 1-D DeviceMesh over `all` (ZeRO 3)


@dataclass
class DHPGroups:
    """The groups one rank takes part in (None where the rank does not host that module).

    ``encoders[name]``: the groups of each encoder module this rank hosts (vision, audio, ...)."""

    topology: Topology
    rank: int
    device: torch.device
    encoders: dict = field(default_factory=dict)   # encoder name -> EncoderGroups
    text_tp: Optional[dist.ProcessGroup] = None
    text_ep: Optional[dist.ProcessGroup] = None   # expert parallel (ray_dhp.parallel.expert)
    text_edp: Optional[dist.ProcessGroup] = None  # expert data parallel: same experts
    text_erep: Optional[dist.ProcessGroup] = None  # every rank holding my experts (EDP x TP)
    text_ep_mesh: Optional[object] = None         # 1-D DeviceMesh over text_ep
    text_dp: Optional[dist.ProcessGroup] = None   # same TP shard: dp x cp ranks (gradients)
    text_cp: Optional[dist.ProcessGroup] = None   # my replica's CP ranks (ray_dhp.parallel.context)
    text_all: Optional[dist.ProcessGroup] = None
    text_mesh: Optional[object] = None              # DeviceMesh ("dp", "tp") on text ranks
    data: Optional[dist.ProcessGroup] = None        # all ranks, gloo: the data loader's exchange

    def hosts(self, name: str) -> bool:
        """Whether this rank hosts module ``name`` ("text" or an encoder's name)."""
        m = self.topology.find(name)
        return m is not None and m.hosts(self.rank)

    def coord(self, name: str) -> Optional[tuple[int, int]]:
        """(dp replica, inner rank) of this rank in module ``name``."""
        m = self.topology.find(name)
        return None if m is None else m.coord(self.rank)

    @property
    def is_vision(self) -> bool:
        return self.hosts("vision")

    @property
    def is_text(self) -> bool:
        return self.hosts("text")

    @property
    def vision_coord(self) -> Optional[tuple[int, int]]:
        """(dp replica, sp rank) of this rank in the vision group."""
        return self.coord("vision")

    @property
    def text_coord(self) -> Optional[tuple[int, int]]:
        """(dp replica, tp rank) of this rank in the text group."""
        return self.coord("text")

    @property
    def text_cp_rank(self) -> int:
        """This rank's context-parallel index inside its text replica (0 without CP)."""
        return self.topology.text.cp_coord(self.rank) if self.is_text else 0



def _new_groups(rank_lists: list[list[int]], rank: int) -> Optional[dist.ProcessGroup]:
    """Create one group per list (collectively, on every rank); return the one holding ``rank``."""
    mine = None
    for ranks in rank_lists:
        g = dist.new_group(ranks)
        if rank in ranks:
            mine = g
    return mine


def build_groups(topology: Topology, device: torch.device) -> DHPGroups:
    """Create every module group of ``topology`` in the current default process group."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before build_groups().")
    if dist.get_world_size() != topology.world_size:
        raise RuntimeError(
            f"world size {dist.get_world_size()} != topology world size {topology.world_size}"
        )
    rank = dist.get_rank()
    t = topology.text
    groups = DHPGroups(topology=topology, rank=rank, device=device)
    # Fixed order on every rank: per encoder (module order) sp, dp, all; then text tp, dp, all.
    for m in topology.encoders:
        eg = EncoderGroups(sp=_new_groups(m.inner_groups(), rank), dp=_new_groups(m.dp_groups(), rank),
                           all=_new_groups([m.ranks], rank))
        if eg.all is not None:
            groups.encoders[m.name] = eg
    groups.text_tp = _new_groups(t.inner_groups(), rank)
    groups.text_dp = _new_groups(t.dp_groups(), rank)
    groups.text_all = _new_groups([t.ranks], rank)
    if t.cp > 1:  # created only with context parallelism (same topology, same order everywhere)
        groups.text_cp = _new_groups(t.cp_groups(), rank)
    ep = topology.text_expert_parallel
    if ep > 1:  # created only with expert parallelism (every rank: same topology, same order)
        from ray_dhp.parallel.expert import edp_groups, ep_groups, replica_groups

        groups.text_ep = _new_groups(ep_groups(t, ep), rank)
        groups.text_edp = _new_groups(edp_groups(t, ep), rank)
        groups.text_erep = _new_groups(replica_groups(t, ep), rank)
    # The data loader exchanges samples from a background thread: its own (CPU) group, so its
    # collectives never interleave with the training ones.
    groups.data = dist.new_group(list(range(topology.world_size)), backend="gloo")
    for m in topology.encoders:  # ZeRO-3: FSDP2 over the whole encoder group
        if m.name in groups.encoders and m.zero_stage == 3:
            from torch.distributed.device_mesh import DeviceMesh

            eg = groups.encoders[m.name]
            eg.mesh = DeviceMesh.from_group(eg.all, device.type, mesh_dim_names=("dp",))
    if groups.is_text:
        from torch.distributed.device_mesh import DeviceMesh

        groups.text_mesh = DeviceMesh.from_group(
            [groups.text_dp, groups.text_tp], device.type,
            mesh=torch.tensor(t.mesh(), dtype=torch.int), mesh_dim_names=("dp", "tp"),
        )
        if ep > 1:
            groups.text_ep_mesh = DeviceMesh.from_group(groups.text_ep, device.type,
                                                        mesh_dim_names=("ep",))
    return groups
