"""Node labels per placement group: Ray Train's per-worker ``label_selector`` and the driver's
check that the cluster has the nodes a run's labels ask for.

``DHPConfig(labels={module: {label key: selector}})`` pins the workers of the placement group
holding ``module`` to nodes whose labels match (``{"accel": "small"}``; Ray's selector syntax:
``"!spot"``, ``"in(a, b)"``, ``"!in(a, b)"``). The modules of one group share its labels.
Ray Train V2 takes one selector per worker (``ScalingConfig(label_selector=[...])``) and asks
for placement-group bundle ``r`` with selector ``r``; `worker_label_selectors` lists them by DHP
rank, so bundle ``r`` lands on a node fit for DHP rank ``r``. Ray Train then numbers its workers
by node, not by bundle: the backend gives every worker a DHP rank of its own bundle's placement
group (`ray_dhp.parallel.nodes.node_local_order` with ``bundles``).

`check_labelled_nodes` runs in the driver (``DisaggregatedTrainer.fit``) before the controller
starts and refuses, naming the label and the counts, a cluster that has fewer nodes (or room for
fewer workers) with a group's labels than the group needs: Ray would otherwise wait for them.
"""

from __future__ import annotations

from typing import Optional

from ray_dhp.config.checks import ConfigError

__all__ = ["check_labels", "group_labels", "worker_label_selectors", "selector_matches",
           "check_labelled_nodes", "worker_room", "LabelRefusal"]


class LabelRefusal(ConfigError):
    """The cluster lacks the nodes (or the room) that a placement group's labels select (a
    ValueError; ``ray-dhp train`` prints it as a configuration error, without a traceback)."""


def check_labels(labels, modules: tuple, key: str = "labels") -> dict:
    """``labels`` (``{module: {label key: selector}}``, None or ``{}``) checked against the
    modules the model trains; returns it as plain dicts. ValueError naming ``key``."""
    if labels is None:
        return {}
    if not isinstance(labels, dict):
        raise ValueError(f"{key} must be a mapping {{module: {{label: value}}}}, e.g. "
                         f"{{'vision': {{'accel': 'small'}}}}, got {labels!r}.")
    out = {}
    for module, sel in labels.items():
        if module not in modules:
            raise ValueError(f"{key}.{module}: unknown module; this model trains {list(modules)}.")
        if not isinstance(sel, dict) or not sel:
            raise ValueError(f"{key}.{module} must be a non-empty mapping of node label to value, "
                             f"e.g. {{'accel': 'small'}}, got {sel!r}.")
        for k, v in sel.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise ValueError(f"{key}.{module}.{k}: label keys and values are strings, got "
                                 f"{k!r}: {v!r}.")
        err = _ray_selector_error(sel)
        if err:
            raise ValueError(f"{key}.{module}: {err}")
        out[module] = dict(sel)
    return out


def _ray_selector_error(sel: dict) -> Optional[str]:
    """Ray's own syntax check of a label selector (None when valid)."""
    try:
        from ray._private.label_utils import validate_label_selector
    except ImportError:  # another Ray: it checks when the placement group is made
        return None
    return validate_label_selector(sel)


def group_labels(topology, labels: dict, key: str = "labels") -> list:
    """``[(placement group, selector)]`` in rank order: each group's selector is the union of its
    modules' labels (``{}``: any node); two modules of one group asking different values for the
    same label is a ValueError naming both keys."""
    out = []
    for g in topology.placement_groups():
        sel, who = {}, {}
        for name in g.names:
            for k, v in labels.get(name, {}).items():
                if k in sel and sel[k] != v:
                    raise ValueError(
                        f"{key}.{who[k]}.{k}={sel[k]!r} and {key}.{name}.{k}={v!r}: {who[k]} and "
                        f"{name} share workers (placement group {list(g.names)}), so they run on "
                        "the same nodes; give them the same labels, or put them in different "
                        "placement groups.")
                sel[k], who[k] = v, name
        out.append((g, sel))
    return out


def worker_label_selectors(topology, labels: dict) -> Optional[list]:
    """Ray Train's per-worker ``label_selector``: one selector per DHP rank (bundle), None when
    no module has labels."""
    if not labels:
        return None
    out = [None] * topology.world_size
    for g, sel in group_labels(topology, labels):
        for r in g.ranks:
            out[r] = dict(sel)
    return out


def selector_matches(node_labels: dict, selector: dict) -> bool:
    """Whether a node with labels ``node_labels`` satisfies ``selector`` (Ray's syntax: a value,
    ``!value``, ``in(a, b)``, ``!in(a, b)``)."""
    for k, want in selector.items():
        negate = want.startswith("!")
        body = want[1:] if negate else want
        if body.startswith("in(") and body.endswith(")"):
            values = {v.strip() for v in body[3:-1].split(",")}
        else:
            values = {body}
        hit = node_labels.get(k) in values
        if hit == negate:
            return False
    return True


def worker_room(resources: dict, per_worker: dict) -> int:
    """How many workers of ``per_worker`` a node with ``resources`` (totals) can hold."""
    return min((int(resources.get(k, 0) // v) for k, v in per_worker.items() if v > 0),
               default=0)


def _describe(selector: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in selector.items())


def check_labelled_nodes(topology, labels: dict, nodes: list, per_worker: dict) -> None:
    """Refuse (`LabelRefusal`) when the alive ``nodes`` (``ray.nodes()`` entries: ``Labels``,
    ``Resources``) that match a placement group's labels hold fewer workers of ``per_worker``
    than the groups with those labels need together."""
    need: dict = {}
    for g, sel in group_labels(topology, labels):
        if sel:
            key = tuple(sorted(sel.items()))
            names, count = need.get(key, ((), 0))
            need[key] = (names + (g.names,), count + g.size)
    for key, (groups, wanted) in need.items():
        sel = dict(key)
        matching = [n for n in nodes if selector_matches(n.get("Labels") or {}, sel)]
        caps = {f"{n.get('NodeManagerAddress')}/{n.get('NodeID', '')[:8]}":
                worker_room(n.get("Resources", {}), per_worker) for n in matching}
        caps = {k: c for k, c in caps.items() if c > 0}
        room = sum(caps.values())
        if room >= wanted:
            continue
        who = " and ".join("+".join(g) for g in groups)
        seen = sorted({f"{k}={v}" for n in nodes for k, v in (n.get("Labels") or {}).items()
                       if k in sel})
        raise LabelRefusal(
            f"ray_dhp: the placement group(s) {who} need {wanted} worker(s) of {per_worker} on "
            f"nodes labelled {_describe(sel)} (labels.{groups[0][0]}), but the cluster has "
            f"{len(matching)} alive node(s) with that label, with room for {room} such "
            f"worker(s){(' (' + ', '.join(f'{n}: {c}' for n, c in caps.items()) + ')') if caps else ''}. "
            f"Values of these label keys on the cluster's nodes: {seen or 'none'}. Add nodes "
            f"with label {_describe(sel)} (ray start --labels=...), lower that group's degrees, "
            "or change labels.")
