"""Which node each DHP rank runs on: keeping sp/tp groups inside a node, as plain data.

Ray Train gives world ranks grouped by node (workers sorted by node, then GPU id), so the
contiguous layout of `ray_dhp.parallel.topology` keeps every sp/tp group inside one node whenever
each node holds whole groups. When it does not (nodes of different sizes, a disjoint split whose
groups differ in size), `node_local_order` permutes the ranks: the DHP rank of a worker may then
differ from its Ray Train world rank.

With node labels per placement group (``DHPConfig(labels=...)``) each worker was placed for one
DHP rank: Ray Train asks for its placement-group bundle ``r`` on a node matching the labels of
rank ``r``'s group, then numbers the workers by node, not by bundle. `node_local_order` then
takes the bundle of every worker and keeps each worker inside the placement group its bundle
was placed for (permuting only within a group). Plain data in, plain data out: unit-tested
without Ray.
"""

from __future__ import annotations

from math import gcd
from typing import Optional, Sequence

__all__ = ["inner_groups", "crossing_groups", "node_local_order", "nodes_by_rank", "fill_nodes"]


def _lcm(a: int, b: int) -> int:
    return a * b // gcd(a, b)


def inner_groups(topology) -> list:
    """``[(label, ranks)]`` of every sp (encoder) and tp (text) group: the chatty collectives."""
    out = []
    for m in topology.modules:
        if m.inner * m.cp > 1:
            label = m.inner_dim if m.cp == 1 else f"cp x {m.inner_dim}"
            out += [(f"{m.name} {label} group {k}", g) for k, g in enumerate(_blocks(m))]
    return out


def _blocks(m) -> list:
    """Each replica's ranks: its sp/tp group, or with context parallelism its cp x tp block
    (the CP all-to-alls beside TP, `ray_dhp.parallel.context`)."""
    return [sum(m.mesh()[d * m.cp:(d + 1) * m.cp], []) for d in range(m.dp)]


def crossing_groups(topology, node_of: Sequence) -> list:
    """``[(label, ranks, nodes)]`` of the sp/tp groups whose DHP ranks span more than one node;
    ``node_of[r]`` is the node of DHP rank ``r``."""
    out = []
    for label, ranks in inner_groups(topology):
        nodes = list(dict.fromkeys(node_of[r] for r in ranks))
        if len(nodes) > 1:
            out.append((label, ranks, nodes))
    return out


def _units(topology) -> list:
    """Logical rank blocks that must share a node for every sp/tp group to be node-local: in each
    placement group, blocks of the least common multiple of its modules' inner degrees."""
    out = []
    for g in topology.placement_groups():
        u = 1
        for m in g.modules:
            u = _lcm(u, m.inner * m.cp)
        out += [list(range(k, k + u)) for k in range(g.offset, g.offset + g.size, u)]
    return out


def _packed(units: list, workers: Sequence, nodes: Sequence) -> dict:
    """``{world rank: DHP rank}`` giving ``units`` (DHP rank blocks) to ``workers`` (world ranks
    on ``nodes[w]``) so that whole units share a node: best fit, largest units first; the units
    no node can hold take the fullest nodes' remaining workers (fewest nodes spanned)."""
    free: dict = {}
    for w in workers:
        free.setdefault(nodes[w], []).append(w)
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
    return {w: r for r, w in world_of.items()}


def _crossings(topology, order: Sequence, nodes: Sequence) -> int:
    return len(crossing_groups(topology, nodes_by_rank(order, nodes)))


def node_local_order(topology, nodes: Sequence, bundles: Optional[Sequence] = None) -> list:
    """The DHP rank of every Ray Train worker: ``order[w]`` for world rank ``w`` on node
    ``nodes[w]``.

    Without ``bundles``: the identity (Ray's node-grouped order) when it already keeps every
    sp/tp group on one node; otherwise the permutation that packs whole groups into nodes (best
    fit, largest first), if it leaves fewer groups across nodes. Groups no node can hold are
    spread over the fewest nodes.

    ``bundles[w]``: the placement-group bundle of world rank ``w``, i.e. the DHP rank whose
    placement group's node labels chose its node. Each worker then takes a DHP rank of that
    same placement group: the bundle itself, or a permutation inside the group where that
    leaves fewer sp/tp groups across nodes.

    Example:
        >>> from ray_dhp.parallel.topology import Topology
        >>> t = Topology.build(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=4)
        >>> node_local_order(t, ["a", "a", "a", "a", "b", "b"])  # text on a, vision on b
        [2, 3, 4, 5, 0, 1]
    """
    n = topology.world_size
    if len(nodes) != n:
        raise ValueError(f"{len(nodes)} workers for a layout of {n}.")
    if bundles is not None:
        if sorted(bundles) != list(range(n)):
            raise ValueError(f"bundles {list(bundles)} are not a permutation of the {n} ranks.")
        return _within_groups(topology, list(nodes), list(bundles))
    identity = list(range(n))
    base = _crossings(topology, identity, nodes)
    if base == 0:
        return identity
    packed = _packed(_units(topology), identity, nodes)
    order = [packed[w] for w in identity]
    return order if _crossings(topology, order, nodes) < base else identity


def _within_groups(topology, nodes: list, bundles: list) -> list:
    """`node_local_order` with every worker kept in its bundle's placement group."""
    order = list(bundles)
    units = _units(topology)
    for g in topology.placement_groups():
        lo, hi = g.offset, g.offset + g.size
        mine = [w for w in range(len(nodes)) if lo <= bundles[w] < hi]
        packed = _packed([u for u in units if lo <= u[0] < hi], mine, nodes)
        trial = [packed.get(w, order[w]) for w in range(len(nodes))]
        if _crossings(topology, trial, nodes) < _crossings(topology, order, nodes):
            order = trial
    return order


def nodes_by_rank(order: Sequence, nodes: Sequence) -> list:
    """``node_of[r]`` for DHP rank ``r`` from ``order`` (world rank -> DHP rank) and ``nodes``."""
    node_of = [None] * len(order)
    for w, r in enumerate(order):
        node_of[r] = nodes[w]
    return node_of


def fill_nodes(topology, gpus_per_node: int) -> list:
    """The node index of every DHP rank when ``gpus_per_node`` workers fill each node in order
    (Ray Train's PACK placement on idle nodes) and the backend orders the ranks node-locally."""
    slots = [r // gpus_per_node for r in range(topology.world_size)]
    return nodes_by_rank(node_local_order(topology, slots), slots)
