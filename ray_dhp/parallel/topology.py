"""Which worker runs what: ranks -> roles, module groups and their meshes, as plain data.

Nothing here touches torch.distributed, so every rule is unit-testable and the driver can
validate a layout before any worker starts.

Rank layout (innermost dimension fastest, like ``init_device_mesh``):

* an encoder group (vision, audio, ...), mesh ``("dp", "sp")``: group-local rank
  ``v = dp * sp_size + sp``
* text group, mesh ``("dp", "tp")``:    group-local rank ``t = (dp * cp_size + cp) * tp_size + tp``
  (context parallelism, ``cp``, sits between dp and tp: a replica's CP x TP ranks are one block,
  node-local like a TP group; the mesh's "dp" rows are the dp x cp gradient replicas)
* ``collocated``: every group spans all workers (world rank = group-local rank).
* ``disjoint``: the encoders take consecutive blocks of world ranks in module order (vision
  ``[0, Nv)``, then e.g. audio ``[Nv, Nv + Na)``), the LM the last block.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

PLACEMENTS = ("collocated", "disjoint")


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

    ``encoders`` holds every encoder module (vision first, then e.g. audio) in rank order: under
    the disjoint placement each takes the next block of world ranks, then the LM; collocated,
    every module spans all workers. Everything that is per module iterates over `modules`."""

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

    def module(self, name: str) -> ModuleLayout:
        m = self.text if name == "text" else self.encoder(name)
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
        """``vision_zero`` / ``text_zero``: the modules' ZeRO stages; None is the default (1 with
        more than one replica, `ray_dhp.parallel.zero.resolve_stage`). ``encoders``: further
        encoder modules, ``{name: EncoderDegrees}`` (e.g. ``{"audio": EncoderDegrees(dp=2)}``),
        laid out after the vision encoder."""
        from ray_dhp.parallel.zero import resolve_stage

        if placement not in PLACEMENTS:
            raise ValueError(
                f"placement={placement!r} is not known; use one of {PLACEMENTS}."
            )
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
        if not isinstance(text_ep, int) or text_ep < 1 or text_dp % text_ep:
            raise ValueError(
                f"text.expert_parallel={text_ep!r} must be a positive integer dividing text."
                f"data_parallel ({text_dp}): the experts are partitioned over data-parallel "
                f"replicas; use one of {[d for d in range(1, text_dp + 1) if text_dp % d == 0]}.")
        if not isinstance(text_sequence_parallel, bool):
            raise ValueError(f"text sequence_parallel must be true or false, got {text_sequence_parallel!r}.")
        if text_sequence_parallel and text_tp == 1:
            raise ValueError(
                "text sequence_parallel=true shards the sequence over the text tensor-parallel ranks "
                "and needs text tensor_parallel > 1; set text.tensor_parallel >= 2 or "
                "text.sequence_parallel=false."
            )
        from ray_dhp.parallel.context import check_context_parallel  # noqa: PLC0415
        from ray_dhp.parallel.expert_tp import check_expert_tp

        check_context_parallel(text_cp, text_ep, text_expert_tp)
        nt = text_dp * text_cp * text_tp
        if placement == "collocated":
            for name, deg in wanted.items():
                if deg.dp * deg.sp != nt:
                    raise ValueError(
                        f"collocated placement needs every module group to span the same workers, "
                        f"but {name} uses {deg.dp}x{deg.sp}={deg.dp * deg.sp} and text "
                        f"{text_dp}x{text_cp}x{text_tp}={nt} workers (dp x cp x tp); change the degrees so the products "
                        f"match, or use placement='disjoint'."
                    )
        layouts, offset = [], 0
        for name, deg in wanted.items():
            zero = resolve_stage(deg.zero, deg.dp * deg.sp, name)
            check_offload(name, deg.offload, zero, 1)
            layouts.append(ModuleLayout(name, "sp", deg.dp, deg.sp, offset, zero, deg.offload))
            if placement == "disjoint":
                offset += deg.dp * deg.sp
        world = nt + offset
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
            placement=placement,
            encoders=tuple(layouts),
            text=ModuleLayout("text", "tp", text_dp, text_tp, offset, text_zero, text_offload,
                              cp=text_cp),
            text_sequence_parallel=text_sequence_parallel,
            text_expert_parallel=text_ep,
            text_expert_tp=text_expert_tp,
        )

    def roles(self, world_rank: int) -> tuple[str, ...]:
        """The modules ``world_rank`` hosts, in module order: e.g. ("vision", "text"),
        ("vision",), ("audio",) or ("text",)."""
        if not 0 <= world_rank < self.world_size:
            raise ValueError(f"rank {world_rank} outside world of size {self.world_size}")
        return tuple(m.name for m in self.modules if m.coord(world_rank) is not None)

    def describe(self) -> str:
        """Human-readable table of which rank runs what (for logs and `ray-dhp plan`)."""
        lines = [f"placement={self.placement} world_size={self.world_size}"
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


# -- nodes --------------------------------------------------------------------------------------
#
# Ray Train gives world ranks grouped by node (workers sorted by node, then GPU id), so the
# contiguous layout above keeps every sp/tp group inside one node whenever each node holds whole
# groups. When it does not (nodes of different sizes, a disjoint split whose groups differ in
# size), `node_local_order` permutes the ranks: the DHP rank of a worker may then differ from its
# Ray Train world rank. Plain data in, plain data out: unit-tested without Ray.


def _lcm(a: int, b: int) -> int:
    from math import gcd

    return a * b // gcd(a, b)


def inner_groups(topology: Topology) -> list:
    """``[(label, ranks)]`` of every sp (encoder) and tp (text) group: the chatty collectives."""
    out = []
    for m in topology.modules:
        if m.inner * m.cp > 1:
            label = m.inner_dim if m.cp == 1 else f"cp x {m.inner_dim}"
            out += [(f"{m.name} {label} group {k}", g) for k, g in enumerate(_blocks(m))]
    return out


def _blocks(m: ModuleLayout) -> list:
    """Each replica's ranks: its sp/tp group, or with CP its cp x tp block (all-to-alls + TP)."""
    return [sum(m.mesh()[d * m.cp:(d + 1) * m.cp], []) for d in range(m.dp)]


def crossing_groups(topology: Topology, node_of: Sequence) -> list:
    """``[(label, ranks, nodes)]`` of the sp/tp groups whose DHP ranks span more than one node;
    ``node_of[r]`` is the node of DHP rank ``r``."""
    out = []
    for label, ranks in inner_groups(topology):
        nodes = list(dict.fromkeys(node_of[r] for r in ranks))
        if len(nodes) > 1:
            out.append((label, ranks, nodes))
    return out


def _units(topology: Topology) -> list:
    """Logical rank blocks that must share a node for every sp/tp group to be node-local."""
    if topology.placement == "collocated":
        u = 1
        for m in topology.modules:
            u = _lcm(u, m.inner * m.cp)
        return [list(range(k, k + u)) for k in range(0, topology.world_size, u)]
    return [g for m in topology.modules for g in _blocks(m)]


def _permuted(topology: Topology, nodes: Sequence) -> list:
    """World rank -> DHP rank that packs whole units into nodes: best fit, largest units first;
    the units no node can hold take the fullest nodes' remaining workers (fewest nodes spanned)."""
    free: dict = {}
    for w, n in enumerate(nodes):
        free.setdefault(n, []).append(w)
    units = _units(topology)
    world_of, spill = {}, []
    for unit in sorted(units, key=len, reverse=True):  # stable: logical order among equals
        fits = [n for n in free if len(free[n]) >= len(unit)]
        if not fits:
            spill.append(unit)
            continue
        n = min(fits, key=lambda n: len(free[n]))
        for r in unit:
            world_of[r] = free[n].pop(0)
    for unit in spill:  # a whole node at a time, fullest first
        rest = list(unit)
        while rest:
            n = max(free, key=lambda n: len(free[n]))
            take, rest = rest[:len(free[n])], rest[len(free[n]):]
            for r in take:
                world_of[r] = free[n].pop(0)
    order = [0] * len(nodes)
    for r, w in world_of.items():
        order[w] = r
    return order


def node_local_order(topology: Topology, nodes: Sequence) -> list:
    """The DHP rank of every Ray Train worker: ``order[w]`` for world rank ``w`` on node
    ``nodes[w]``.

    The identity (Ray's node-grouped order) when it already keeps every sp/tp group on one node;
    otherwise the permutation that packs whole groups into nodes (best fit, largest first), if it
    leaves fewer groups across nodes. Groups no node can hold are spread over the fewest nodes.

    Example:
        >>> t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=4)
        >>> node_local_order(t, ["a", "a", "a", "a", "b", "b"])  # text on a, vision on b
        [2, 3, 4, 5, 0, 1]
    """
    if len(nodes) != topology.world_size:
        raise ValueError(f"{len(nodes)} workers for a layout of {topology.world_size}.")
    identity = list(range(topology.world_size))
    base = len(crossing_groups(topology, list(nodes)))
    if base == 0:
        return identity
    order = _permuted(topology, nodes)
    better = len(crossing_groups(topology, nodes_by_rank(order, nodes))) < base
    return order if better else identity


def nodes_by_rank(order: Sequence, nodes: Sequence) -> list:
    """``node_of[r]`` for DHP rank ``r`` from ``order`` (world rank -> DHP rank) and ``nodes``."""
    node_of = [None] * len(order)
    for w, r in enumerate(order):
        node_of[r] = nodes[w]
    return node_of


def fill_nodes(topology: Topology, gpus_per_node: int) -> list:
    """The node index of every DHP rank when ``gpus_per_node`` workers fill each node in order
    (Ray Train's PACK placement on idle nodes) and the backend orders the ranks node-locally."""
    slots = [r // gpus_per_node for r in range(topology.world_size)]
    return nodes_by_rank(node_local_order(topology, slots), slots)


def check_offload(module: str, offload, stage: int, tp: int) -> None:
    """Refuse a value or combination offload does not support, naming ``<module>.optimizer_offload``."""
    if not isinstance(offload, bool):
        raise ValueError(f"{module}.optimizer_offload must be true or false, got {offload!r}.")
    if offload and (tp > 1 or stage == 3):
        raise ValueError(
            f"{module}.optimizer_offload=true needs plain parameters, but {module} has "
            + ("tensor_parallel > 1" if tp > 1 else "zero_stage=3 (FSDP2)")
            + " (DTensor shards); set "
            + ("text.tensor_parallel=1 and " if module == "text" else "")
            + f"{module}.zero_stage <= 2, or {module}.optimizer_offload=false.")
