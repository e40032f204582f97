"""Which worker runs what: ranks -> roles, module groups and their meshes, as plain data.

Nothing here touches torch.distributed, so every rule is unit-testable and the driver can
validate a layout before any worker starts.

Rank layout (innermost dimension fastest, like ``init_device_mesh``):

* an encoder group (vision, audio, ...), mesh ``("dp", "sp")``: group-local rank
  ``v = dp * sp_size + sp``
* text group, mesh ``("dp", "tp")``:    group-local rank ``t = (dp * cp_size + cp) * tp_size + tp``
  (context parallelism, ``cp``, sits between dp and tp: a replica's CP x TP ranks are one block,
  node-local like a TP group; the mesh's "dp" rows are the dp x cp gradient replicas)
* modules are grouped into *placement groups*: the modules of one group share its workers
  (collocated: each spans all of them, world rank = offset + group-local rank), and every group
  has workers of its own, blocks of consecutive world ranks in the order of each group's first
  module (vision, then further encoders such as audio, then text).
* ``collocated`` is one group of every module, ``disjoint`` one group per module (vision
  ``[0, Nv)``, then e.g. audio ``[Nv, Nv + Na)``, the LM the last block); a grouping such as
  ``[["vision", "text"], ["audio"]]`` lies between them (`placement_groups`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

PLACEMENTS = ("collocated", "disjoint")  # the two shorthands of a grouping


def placement_groups(placement, names: Sequence[str], key: str = "placement") -> tuple:
    """The placement groups of ``placement`` over the modules ``names`` (in rank order), as a
    tuple of name tuples in rank order: ``"collocated"`` (one group), ``"disjoint"`` (one group
    per module) or a grouping, a list of lists of module names (``[["vision", "text"],
    ["audio"]]``) giving every module exactly once. Groups and their members are put in module
    order, so equal groupings give equal layouts. ValueError naming ``key`` otherwise.

    Example:
        >>> placement_groups([["text", "vision"], ["audio"]], ("vision", "audio", "text"))
        (('vision', 'text'), ('audio',))
    """
    names = tuple(names)
    if placement == "collocated":
        return (names,)
    if placement == "disjoint":
        return tuple((n,) for n in names)
    how = (f"use 'collocated', 'disjoint' or a list of groups of module names such as "
           f"{[list(names[:-1]), [names[-1]]]} giving each of {list(names)} once")
    if isinstance(placement, str) or not isinstance(placement, (list, tuple)) or not placement:
        raise ValueError(f"{key}={placement!r} is not known; {how}.")
    seen: dict = {}
    for k, group in enumerate(placement):
        if isinstance(group, str) or not isinstance(group, (list, tuple)) or not group:
            raise ValueError(f"{key}[{k}]={group!r}: each group is a non-empty list of module "
                             f"names; {how}.")
        for n in group:
            if n not in names:
                raise ValueError(f"{key}[{k}]: unknown module {n!r}; this model trains "
                                 f"{list(names)} ({how}).")
            if n in seen:
                raise ValueError(f"{key}: module {n!r} is in group {seen[n]} and group {k}; "
                                 f"give each module once ({how}).")
            seen[n] = k
    missing = [n for n in names if n not in seen]
    if missing:
        raise ValueError(f"{key}: module(s) {missing} are in no group; {how}.")
    groups = [tuple(n for n in names if n in g) for g in placement]
    return tuple(sorted(groups, key=lambda g: names.index(g[0])))


def placement_name(groups: tuple) -> str:
    """``"collocated"`` / ``"disjoint"`` when ``groups`` is one of the shorthands, else
    ``"grouped"``."""
    if len(groups) == 1:
        return "collocated"
    return "disjoint" if all(len(g) == 1 for g in groups) else "grouped"


@dataclass(frozen=True)
class PlacementGroup:
    """One placement group: its modules' layouts (they share the group's workers), its first
    world rank and its number of workers."""

    modules: tuple
    offset: int
    size: int

    @property
    def names(self) -> tuple:
        return tuple(m.name for m in self.modules)

    @property
    def ranks(self) -> list[int]:
        return list(range(self.offset, self.offset + self.size))


@dataclass(frozen=True)
class ModuleLayout:
    """One module group: ``dp`` replicas of an ``inner``-way sharded module (sp or tp)."""

    name: str  # "vision" | "audio" | ... | "text"
    inner_dim: str  # "sp" | "tp"
    dp: int
    inner: int
    offset: int  # world rank of group-local rank 0
    # ZeRO stage of the module's state over its replicas (`ray_dhp.parallel.zero`): 0-3
    zero_stage: int = 0
    # masters and AdamW moments in host memory, updated there (`ray_dhp.step.offload`)
    offload: bool = False
    # context parallelism (text only): each replica's sequence split over ``cp`` blocks of
    # ``inner`` ranks (`ray_dhp.parallel.context`)
    cp: int = 1

    @property
    def size(self) -> int:
        return self.dp * self.cp * self.inner

    @property
    def ranks(self) -> list[int]:
        return list(range(self.offset, self.offset + self.size))

    def hosts(self, world_rank: int) -> bool:
        """Whether ``world_rank`` is one of this module's ranks."""
        return 0 <= world_rank - self.offset < self.size

    def coord(self, world_rank: int) -> Optional[tuple[int, int]]:
        """(dp index, inner index) of ``world_rank``, or None if it is not in this group (the
        CP rank is `cp_coord`'s)."""
        local = world_rank - self.offset
        if not 0 <= local < self.size:
            return None
        row, inner = divmod(local, self.inner)
        return row // self.cp, inner

    def cp_coord(self, world_rank: int) -> int:
        """The context-parallel rank of ``world_rank`` inside its replica (0 without CP)."""
        return ((world_rank - self.offset) // self.inner) % self.cp

    def grad_index(self, world_rank: int) -> int:
        """Index of ``world_rank`` in its `dp_groups` list (its gradient replica: dp x cp)."""
        return (world_rank - self.offset) // self.inner

    def rank_at(self, dp: int, inner: int, cp: int = 0) -> int:
        return self.offset + (dp * self.cp + cp) * self.inner + inner

    def mesh(self) -> list[list[int]]:
        """World ranks as a ``[dp x cp][inner]`` grid (the DeviceMesh layout: rows are the
        gradient replicas, CP ranks replicate the parameters like data-parallel ones)."""
        return [[self.rank_at(d, i, c) for i in range(self.inner)]
                for d in range(self.dp) for c in range(self.cp)]

    def inner_groups(self) -> list[list[int]]:
        """One rank list per replica (and CP rank): the sp (encoder) or tp (text) groups."""
        return self.mesh()

    def dp_groups(self) -> list[list[int]]:
        """One rank list per inner index: the groups that hold the same shard (with CP, the
        dp x cp ranks: gradients are summed and ZeRO partitions over them)."""
        return [[self.rank_at(d, i, c) for d in range(self.dp) for c in range(self.cp)]
                for i in range(self.inner)]

    def cp_groups(self) -> list[list[int]]:
        """One rank list per (replica, inner index): the ranks splitting one sequence."""
        return [[self.rank_at(d, i, c) for c in range(self.cp)]
                for d in range(self.dp) for i in range(self.inner)]


@dataclass(frozen=True)
class EncoderDegrees:
    """What one encoder module asks for: ``dp`` replicas of an ``sp``-way sequence-parallel
    tower, its ZeRO stage (None: the default) and whether its optimizer state lives on the host.
    `Topology.build` takes the vision encoder's as keywords and any other encoder's (audio, ...)
    in ``encoders``: one code path for every encoder."""

    dp: int = 1
    sp: int = 1
    zero: Optional[int] = None
    offload: bool = False


@dataclass(frozen=True)
class Topology:
    """The whole layout: world size, placement, the encoder groups and the LM's group.

    ``encoders`` holds every encoder module (vision first, then e.g. audio) in rank order. Each
    placement group (``groups``: module names per group, in rank order) takes the next block of
    world ranks and its modules span all of that block; ``placement`` names the grouping
    (``collocated``, ``disjoint`` or ``grouped``). Everything that is per module iterates over
    `modules`, everything per group over `placement_groups`."""

    world_size: int
    placement: str
    encoders: tuple  # ModuleLayout per encoder, in rank order
    text: ModuleLayout
    # Megatron sequence parallelism in the language model: between the TP regions the hidden
    # states are sharded along the sequence over the text TP ranks (needs text_tp > 1).
    text_sequence_parallel: bool = False
    # Expert parallelism of a mixture-of-experts LM: each sparse layer's experts partitioned
    # over this many text data-parallel replicas (`ray_dhp.parallel.expert`).
    text_expert_parallel: int = 1
    # ... or every expert's intermediate dim sharded over the text TP ranks like a dense MLP
    # (`ray_dhp.parallel.expert_tp`).
    text_expert_tp: bool = False
    # the placement groups' module names, in rank order (empty: one group per distinct offset)
    groups: tuple = ()

    def placement_groups(self) -> list:
        """Every `PlacementGroup` in rank order."""
        groups = self.groups or tuple(
            tuple(m.name for m in self.modules if m.offset == off)
            for off in dict.fromkeys(m.offset for m in self.modules))
        out = []
        for g in groups:
            mods = tuple(self.module(n) for n in g)
            out.append(PlacementGroup(mods, mods[0].offset, mods[0].size))
        return out

    def group_of(self, name: str) -> "PlacementGroup":
        """The placement group holding module ``name``."""
        return next(g for g in self.placement_groups() if name in g.names)

    @property
    def text_context_parallel(self) -> int:
        """The LM's context-parallel degree (`ray_dhp.parallel.context`)."""
        return self.text.cp

    @property
    def modules(self) -> tuple:
        """Every module's layout: the encoders in rank order, then the LM."""
        return (*self.encoders, self.text)

    @property
    def encoder_names(self) -> tuple:
        return tuple(m.name for m in self.encoders)

    def encoder(self, name: str) -> Optional[ModuleLayout]:
        """The layout of encoder ``name``, or None if the model trains without it."""
        return next((m for m in self.encoders if m.name == name), None)

    def find(self, name: str) -> Optional[ModuleLayout]:
        """The layout of module ``name`` (an encoder or the LM), or None if there is none."""
        return next((m for m in self.modules if m.name == name), None)

    def hosted(self, world_rank: int) -> tuple:
        """The layouts of the modules ``world_rank`` hosts, in module order (`roles`' layouts)."""
        return tuple(m for m in self.modules if m.hosts(world_rank))

    def module(self, name: str) -> ModuleLayout:
        m = self.find(name)
        if m is None:
            raise KeyError(f"no module {name!r} in this layout (modules: "
                           f"{[x.name for x in self.modules]})")
        return m

    @property
    def vision(self) -> ModuleLayout:
        """The vision encoder's layout (every family here has one)."""
        return self.module("vision")

    @classmethod
    def build(
        cls, *, placement: str, vision_dp: int, vision_sp: int, text_dp: int, text_tp: int,
        text_sequence_parallel: bool = False, vision_zero: Optional[int] = None,
        text_zero: Optional[int] = None, vision_offload: bool = False, text_offload: bool = False,
        text_ep: int = 1, text_expert_tp: bool = False, encoders: Optional[dict] = None,
        text_cp: int = 1,
    ) -> "Topology":
        """``placement``: ``"collocated"``, ``"disjoint"`` or a grouping of the module names
        (`placement_groups`). ``vision_zero`` / ``text_zero``: the modules' ZeRO stages; None is
        the default (1 with more than one replica, `ray_dhp.parallel.zero.resolve_stage`).
        ``encoders``: further encoder modules, ``{name: EncoderDegrees}`` (e.g. ``{"audio":
        EncoderDegrees(dp=2)}``), laid out after the vision encoder."""
        from ray_dhp.parallel.zero import resolve_stage

        wanted = {"vision": EncoderDegrees(vision_dp, vision_sp, vision_zero, vision_offload)}
        for name, deg in (encoders or {}).items():
            if name in wanted or name == "text" or not isinstance(deg, EncoderDegrees):
                raise ValueError(f"encoder {name!r}: give each further encoder once, by a name other "
                                 f"than 'vision'/'text', as an EncoderDegrees (got {deg!r}).")
            wanted[name] = deg
        for name, deg in wanted.items():
            for what, v in (("data_parallel", deg.dp), ("sequence_parallel", deg.sp)):
                if not isinstance(v, int) or v < 1:
                    raise ValueError(f"{name} {what} must be a positive integer, got {v!r}.")
        for what, v in (("text data_parallel", text_dp), ("text tensor_parallel", text_tp),
                        ("text context_parallel", text_cp)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{what} must be a positive integer, got {v!r}.")
        reps = text_dp * text_cp if isinstance(text_cp, int) else text_dp
        if not isinstance(text_ep, int) or text_ep < 1 or reps % text_ep:
            what = (f"data_parallel ({text_dp})" if text_cp == 1 else
                    f"data_parallel x text.context_parallel ({text_dp} x {text_cp})")
            raise ValueError(
                f"text.expert_parallel={text_ep!r} must be a positive integer dividing text."
                f"{what}: the experts are partitioned over the ranks holding different tokens; "
                f"use one of {[d for d in range(1, reps + 1) if reps % d == 0]}.")
        if not isinstance(text_sequence_parallel, bool):
            raise ValueError(f"text sequence_parallel must be true or false, got {text_sequence_parallel!r}.")
        if text_sequence_parallel and text_tp == 1:
            raise ValueError(
                "text sequence_parallel=true shards the sequence over the text tensor-parallel ranks "
                "and needs text tensor_parallel > 1; set text.tensor_parallel >= 2 or "
                "text.sequence_parallel=false."
            )
        from ray_dhp.parallel.context import check_context_parallel
        from ray_dhp.parallel.expert_tp import check_expert_tp

        check_context_parallel(text_cp, text_ep, text_expert_tp)
        nt = text_dp * text_cp * text_tp
        groups = placement_groups(placement, (*wanted, "text"))
        sizes = {**{n: (f"{d.dp}x{d.sp}", d.dp * d.sp) for n, d in wanted.items()},
                 "text": (f"{text_dp}x{text_tp}" if text_cp == 1
                          else f"{text_dp}x{text_cp}x{text_tp} (dp x cp x tp)", nt)}
        offsets, world = _group_offsets(groups, sizes)
        layouts = []
        for name, deg in wanted.items():
            zero = resolve_stage(deg.zero, deg.dp * deg.sp, name)
            check_offload(name, deg.offload, zero, None)
            layouts.append(ModuleLayout(name, "sp", deg.dp, deg.sp, offsets[name], zero,
                                        deg.offload))
        text_zero = resolve_stage(text_zero, text_dp * text_cp, "text")  # CP ranks: replicas too
        check_offload("text", text_offload, text_zero, text_tp)
        if text_ep > 1 and text_zero == 3:
            raise ValueError("text.expert_parallel > 1 is not covered with text.zero_stage=3 "
                             "(FSDP2 over the experts' EP shards); use text.zero_stage 0-2.")
        if text_ep > 1 and text_offload:
            raise ValueError("text.optimizer_offload=true is not covered with text.expert_parallel > 1 "
                             "(the experts are DTensor shards); set text.optimizer_offload=false.")
        check_expert_tp(text_expert_tp, text_tp, text_ep, text_zero)
        return cls(
            world_size=world,
            placement=placement_name(groups),
            encoders=tuple(layouts),
            text=ModuleLayout("text", "tp", text_dp, text_tp, offsets["text"], text_zero,
                              text_offload, cp=text_cp),
            text_sequence_parallel=text_sequence_parallel,
            text_expert_parallel=text_ep,
            text_expert_tp=text_expert_tp,
            groups=groups,
        )

    def roles(self, world_rank: int) -> tuple[str, ...]:
        """The modules ``world_rank`` hosts, in module order: e.g. ("vision", "text"),
        ("vision",), ("audio",) or ("text",)."""
        if not 0 <= world_rank < self.world_size:
            raise ValueError(f"rank {world_rank} outside world of size {self.world_size}")
        return tuple(m.name for m in self.modules if m.coord(world_rank) is not None)

    def describe(self) -> str:
        """Human-readable table of which rank runs what (for logs and `ray-dhp plan`)."""
        how = self.placement if self.placement != "grouped" else " | ".join(
            "+".join(g) for g in self.groups)
        lines = [f"placement={how} world_size={self.world_size}"
                 + (" text_sequence_parallel=true" if self.text_sequence_parallel else "")
                 + (f" text_expert_parallel={self.text_expert_parallel}"
                    if self.text_expert_parallel > 1 else "")
                 + (" text_expert_tensor_parallel=true" if self.text_expert_tp else "")
                 + (f" text_context_parallel={self.text.cp}" if self.text.cp > 1 else "")]
        for r in range(self.world_size):
            parts = [f"{m.name}(dp={c[0]}, " + (f"cp={m.cp_coord(r)}, " if m.cp > 1 else "")
                     + f"{m.inner_dim}={c[1]})"
                     for m in self.modules if (c := m.coord(r)) is not None]
            lines.append(f"  rank {r}: " + " + ".join(parts))
        return "\n".join(lines)


def _group_offsets(groups: tuple, sizes: dict) -> tuple:
    """``({module: first world rank}, world size)``: each placement group takes the next block of
    ranks; ``sizes[name] = (degrees text, workers)``. ValueError when the modules of a group
    span different numbers of workers."""
    offsets, offset = {}, 0
    for g in groups:
        ref = g[-1]  # the LM when it is in the group
        bad = [n for n in g if sizes[n][1] != sizes[ref][1]]
        if bad:
            which = ("collocated placement" if len(g) == len(sizes)
                     else f"the placement group {list(g)}")
            raise ValueError(
                f"{which} needs every module group to span the same workers, but {bad[0]} "
                f"uses {sizes[bad[0]][0]}={sizes[bad[0]][1]} and {ref} "
                f"{sizes[ref][0]}={sizes[ref][1]} workers; change the degrees so the products "
                f"match, or give these modules placement groups of their own "
                f"(placement='disjoint').")
        offsets.update({n: offset for n in g})
        offset += sizes[g[0]][1]
    return offsets, offset


def check_offload(module: str, offload, stage: int, tp: Optional[int]) -> None:
    """Refuse a value or combination offload does not support, naming ``<module>.optimizer_offload``
    (``tp``: the module's tensor-parallel degree; None for a module without one, an encoder)."""
    if not isinstance(offload, bool):
        raise ValueError(f"{module}.optimizer_offload must be true or false, got {offload!r}.")
    if offload and ((tp or 1) > 1 or stage == 3):
        raise ValueError(
            f"{module}.optimizer_offload=true needs plain parameters, but {module} has "
            + ("tensor_parallel > 1" if (tp or 1) > 1 else "zero_stage=3 (FSDP2)")
            + " (DTensor shards); set "
            + (f"{module}.tensor_parallel=1 and " if tp is not None else "")
            + f"{module}.zero_stage <= 2, or {module}.optimizer_offload=false.")
