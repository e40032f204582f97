"""Which worker runs what: ranks -> roles, module groups and their meshes, as plain data.

Nothing here touches torch.distributed, so every rule is unit-testable and the driver can
validate a layout before any worker starts.

Rank layout (innermost dimension fastest, like ``init_device_mesh``):

* vision group, mesh ``("dp", "sp")``: group-local rank ``v = dp * sp_size + sp``
* text group, mesh ``("dp", "tp")``:    group-local rank ``t = dp * tp_size + tp``
* ``collocated``: both groups span all workers (world rank = group-local rank).
* ``disjoint``: vision workers are world ranks ``[0, Nv)``, text workers ``[Nv, Nv + Nt)``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PLACEMENTS = ("collocated", "disjoint")


@dataclass(frozen=True)
class ModuleLayout:
    """One module group: ``dp`` replicas of an ``inner``-way sharded module (sp or tp)."""

    name: str  # "vision" | "text"
    inner_dim: str  # "sp" | "tp"
    dp: int
    inner: int
    offset: int  # world rank of group-local rank 0

    @property
    def size(self) -> int:
        return self.dp * self.inner

    @property
    def ranks(self) -> list[int]:
        return list(range(self.offset, self.offset + self.size))

    def coord(self, world_rank: int) -> Optional[tuple[int, int]]:
        """(dp index, inner index) of ``world_rank``, or None if it is not in this group."""
        local = world_rank - self.offset
        if not 0 <= local < self.size:
            return None
        return divmod(local, self.inner)

    def rank_at(self, dp: int, inner: int) -> int:
        return self.offset + dp * self.inner + inner

    def mesh(self) -> list[list[int]]:
        """World ranks as a ``[dp][inner]`` grid (the DeviceMesh layout)."""
        return [[self.rank_at(d, i) for i in range(self.inner)] for d in range(self.dp)]

    def inner_groups(self) -> list[list[int]]:
        """One rank list per replica: the sp (vision) or tp (text) groups."""
        return self.mesh()

    def dp_groups(self) -> list[list[int]]:
        """One rank list per inner index: the groups that hold the same shard."""
        return [[self.rank_at(d, i) for d in range(self.dp)] for i in range(self.inner)]


@dataclass(frozen=True)
class Topology:
    """The whole layout: world size, placement and both module groups."""

    world_size: int
    placement: str
    vision: ModuleLayout
    text: ModuleLayout
    # Megatron sequence parallelism in the language model: between the TP regions the hidden
    # states are sharded along the sequence over the text TP ranks (needs text_tp > 1).
    text_sequence_parallel: bool = False

    @classmethod
    def build(
        cls, *, placement: str, vision_dp: int, vision_sp: int, text_dp: int, text_tp: int,
        text_sequence_parallel: bool = False,
    ) -> "Topology":
        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement={placement!r} is not known; use one of {PLACEMENTS}."
            )
        for what, v in (("vision data_parallel", vision_dp), ("vision sequence_parallel", vision_sp),
                        ("text data_parallel", text_dp), ("text tensor_parallel", text_tp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}.")
        if not isinstance(text_sequence_parallel, bool):
            raise ValueError(f"text sequence_parallel must be true or false, got {text_sequence_parallel!r}.")
        if text_sequence_parallel and text_tp == 1:
            raise ValueError(
                "text sequence_parallel=true shards the sequence over the text tensor-parallel ranks "
                "and needs text tensor_parallel > 1; set text.tensor_parallel >= 2 or "
                "text.sequence_parallel=false."
            )
        nv, nt = vision_dp * vision_sp, text_dp * text_tp
        if placement == "collocated":
            if nv != nt:
                raise ValueError(
                    f"collocated placement needs both module groups to span the same workers, but "
                    f"vision uses {vision_dp}x{vision_sp}={nv} and text {text_dp}x{text_tp}={nt} "
                    f"workers; change the degrees so the products match, or use placement='disjoint'."
                )
            world, text_offset = nv, 0
        else:
            world, text_offset = nv + nt, nv
        return cls(
            world_size=world,
            placement=placement,
            vision=ModuleLayout("vision", "sp", vision_dp, vision_sp, 0),
            text=ModuleLayout("text", "tp", text_dp, text_tp, text_offset),
            text_sequence_parallel=text_sequence_parallel,
        )

    def roles(self, world_rank: int) -> tuple[str, ...]:
        """The modules ``world_rank`` hosts: ("vision", "text"), ("vision",) or ("text",)."""
        if not 0 <= world_rank < self.world_size:
            raise ValueError(f"rank {world_rank} outside world of size {self.world_size}")
        return tuple(m.name for m in (self.vision, self.text) if m.coord(world_rank) is not None)

    def describe(self) -> str:
        """Human-readable table of which rank runs what (for logs and `ray-dhp plan`)."""
        lines = [f"placement={self.placement} world_size={self.world_size}"
                 + (" text_sequence_parallel=true" if self.text_sequence_parallel else "")]
        for r in range(self.world_size):
            parts = []
            if (c := self.vision.coord(r)) is not None:
                parts.append(f"vision(dp={c[0]}, sp={c[1]})")
            if (c := self.text.coord(r)) is not None:
                parts.append(f"text(dp={c[0]}, tp={c[1]})")
            lines.append(f"  rank {r}: " + " + ".join(parts))
        return "\n".join(lines)
