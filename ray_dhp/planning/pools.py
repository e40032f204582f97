"""Pools of accelerators a plan can place its module groups on: the ``hardware:`` section of a
run file and the ``ray-dhp plan --pool POOL.yaml`` file, one shape for both.

```yaml
pools:                        # one entry per pool: nodes of one accelerator type
  h100:
    accelerator: h100         # a row of ray_dhp/planning/devices.py, or one of `accelerators:`
    devices_per_node: 8
    nodes: 1
    price_per_device_hour: 2.5   # optional: ranks layouts by tokens per price unit too
    labels: {pool: h100}      # optional: the Ray node labels of the pool (-> placement.labels)
  l40s: {accelerator: l40s, devices_per_node: 8, nodes: 1, price_per_device_hour: 0.9,
         labels: {pool: l40s}}
accelerators:                 # optional: your own kinds (the same keys as a pool's overrides)
  my-gpu: {memory_gib: 48, peak_bf16_tflops: 300, link_gbs: 25, internode_gbs: 11}
```

A pool (or an ``accelerators:`` entry) may give, over its accelerator's figures or instead of an
``accelerator``: ``memory_gib`` (what the runtime reports per device), ``peak_bf16_tflops``
(dense), ``link_gbs`` (per device and direction inside a node), ``internode_gbs`` (per device
between nodes), ``hbm_tbs`` (memory bandwidth; default 2.0 for a kind of your own),
``margin_gib`` (default: the kind's rule, `ray_dhp.planning.devices.Accelerator.margin_gib`) and
``efficiency`` (achieved fraction of the peak; default the planner's, ``--efficiency``). Without an
``accelerator`` the first four are required. Every mistake is a ValueError naming the key as
written (``pools.h100.nodes``, under ``hardware.`` in a run file) and what to write instead.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Optional

from ray_dhp.planning.devices import ACCELERATORS, Accelerator, DeviceBudget

__all__ = ["Pool", "parse_pools", "load_pool_file", "POOL_KEYS", "FIGURE_KEYS"]

#: The figures a pool or an ``accelerators:`` entry may set: key -> (Accelerator field, scale).
FIGURE_KEYS = {"memory_gib": ("memory_gib", 1.0), "peak_bf16_tflops": ("peak_bf16", 1e12),
               "link_gbs": ("link_gbs", 1.0), "internode_gbs": ("internode_gbs", 1.0),
               "hbm_tbs": ("hbm_tbs", 1.0)}
_REQUIRED_OWN = ("memory_gib", "peak_bf16_tflops", "link_gbs", "internode_gbs")
_OWN_HBM_TBS = 2.0
POOL_KEYS = ("accelerator", "devices_per_node", "nodes", "price_per_device_hour", "labels",
             "margin_gib", "efficiency") + tuple(FIGURE_KEYS)
_TOP_KEYS = ("pools", "accelerators")


@dataclass(frozen=True)
class Pool:
    """``nodes`` nodes of ``devices_per_node`` devices of one `Accelerator` kind, with an
    optional price per device-hour and the Ray node labels that select them."""

    name: str
    accelerator: Accelerator
    devices_per_node: int
    nodes: int
    margin_gib: float
    price_per_device_hour: Optional[float] = None
    labels: dict = field(default_factory=dict)
    efficiency: Optional[float] = None

    @property
    def devices(self) -> int:
        return self.devices_per_node * self.nodes

    def budget(self) -> DeviceBudget:
        """What a rank on this pool must fit in: its memory less its margin."""
        return DeviceBudget(f"{self.name} ({self.accelerator.name})",
                            self.accelerator.memory_gib, self.margin_gib)

    def hardware(self, efficiency: float, dtype_bytes: int):
        """The cost model's `ray_dhp.planning.cost_types.Hardware` of one device of this pool.
        With 4-byte activations the peak is scaled by the H100's fp32 / bf16 ratio (67 / 989:
        PyTorch's default fp32 matmuls do not use tensor cores), an approximation."""
        from ray_dhp.planning.cost_types import Hardware

        a = self.accelerator
        peak = a.peak_bf16 if dtype_bytes <= 2 else a.peak_bf16 * 67 / 989
        return Hardware(peak_flops=peak, efficiency=self.efficiency or efficiency,
                        link_bw=a.link_gbs * 1e9, internode_bw=a.internode_gbs * 1e9,
                        hbm_bw=a.hbm_tbs * 1e12, gpus_per_node=self.devices_per_node)

    def describe(self) -> str:
        a = self.accelerator
        price = (f", {self.price_per_device_hour:g} per device-hour"
                 if self.price_per_device_hour is not None else ", no price")
        labels = (", labels " + ", ".join(f"{k}={v}" for k, v in self.labels.items())
                  if self.labels else "")
        return (f"{self.name}: {self.nodes} x {self.devices_per_node} {a.name} "
                f"({a.memory_gib:g} GiB less a {self.margin_gib:g} GiB margin, "
                f"{a.peak_bf16 / 1e12:g} TFLOP/s bf16, links {a.link_gbs:g} GB/s in a node / "
                f"{a.internode_gbs:g} GB/s between nodes{price}{labels})")


def _number(value, key: str, *, positive: bool = True, integer: bool = False):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if not ok or (value <= 0 if positive else value < 0):
        kind = "a positive integer" if integer else ("a positive number" if positive
                                                      else "a number >= 0")
        raise ValueError(f"{key}: {value!r} must be {kind}.")
    return int(value) if integer else float(value)


def _mapping(value, key: str, what: str) -> dict:
    if not isinstance(value, dict):
        raise ValueError(f"{key}: expected a mapping of {what}, got {type(value).__name__} "
                         f"{value!r}.")
    return value


def _unknown(entry: dict, known, key: str) -> None:
    bad = [k for k in entry if k not in known]
    if bad:
        import difflib

        hint = difflib.get_close_matches(str(bad[0]), known, n=1)
        raise ValueError(f"{key}.{bad[0]}: unknown key" + (f" (did you mean {hint[0]!r}?)"
                                                           if hint else "")
                         + f"; known: {', '.join(known)}.")


def _with_figures(base: Accelerator, entry: dict, key: str) -> Accelerator:
    over = {field_: _number(entry[k], f"{key}.{k}") * scale
            for k, (field_, scale) in FIGURE_KEYS.items() if k in entry}
    return replace(base, **over) if over else base


def _own_kinds(data, key: str) -> dict:
    """``accelerators:``: the user's kinds, ``{name: Accelerator}``."""
    out = {}
    for name, entry in _mapping(data, key, "accelerator names to their figures").items():
        k = f"{key}.{name}"
        entry = _mapping(entry, k, "figures")
        _unknown(entry, tuple(FIGURE_KEYS), k)
        missing = [m for m in _REQUIRED_OWN if m not in entry]
        if missing:
            raise ValueError(f"{k}: missing {', '.join(missing)} (a kind of your own gives "
                             f"{', '.join(_REQUIRED_OWN)}; hbm_tbs is optional).")
        base = Accelerator(str(name), str(name), 1.0, 1.0, hbm_tbs=_OWN_HBM_TBS)
        out[str(name)] = _with_figures(base, entry, k)
    return out


def _pool(name, entry, kinds: dict, key: str) -> Pool:
    entry = _mapping(entry, key, "pool settings")
    _unknown(entry, POOL_KEYS, key)
    for k in ("devices_per_node", "nodes"):
        if k not in entry:
            raise ValueError(f"{key}.{k}: missing (how many devices per node, how many nodes).")
    kind = entry.get("accelerator")
    if kind is None:
        missing = [m for m in _REQUIRED_OWN if m not in entry]
        if missing:
            raise ValueError(f"{key}.accelerator: missing; name a known kind "
                             f"({', '.join(list(ACCELERATORS) + list(kinds))}) or give "
                             f"{', '.join(missing)}.")
        base = Accelerator(str(name), str(name), 1.0, 1.0, hbm_tbs=_OWN_HBM_TBS)
    elif kind in kinds or kind in ACCELERATORS:
        base = kinds.get(kind) or ACCELERATORS[kind]
    else:
        raise ValueError(f"{key}.accelerator: unknown accelerator {kind!r}; known: "
                         f"{', '.join(list(ACCELERATORS) + list(kinds))} (add your own under "
                         "accelerators:).")
    acc = _with_figures(base, entry, key)
    margin = (_number(entry["margin_gib"], f"{key}.margin_gib", positive=False)
              if "margin_gib" in entry else acc.margin_gib)
    if margin >= acc.memory_gib:
        raise ValueError(f"{key}.margin_gib: {margin:g} GiB leaves nothing of the device's "
                         f"{acc.memory_gib:g} GiB; lower it.")
    labels = _mapping(entry.get("labels") or {}, f"{key}.labels", "label names to values")
    for lk, lv in labels.items():
        if not isinstance(lk, str) or not isinstance(lv, (str, int, float)) or isinstance(lv, bool):
            raise ValueError(f"{key}.labels.{lk}: a label is a name and a string value, got "
                             f"{lv!r}.")
    eff = entry.get("efficiency")
    if eff is not None and not (isinstance(eff, (int, float)) and 0 < eff <= 1):
        raise ValueError(f"{key}.efficiency: {eff!r} must be in (0, 1].")
    price = entry.get("price_per_device_hour")
    return Pool(str(name), acc, _number(entry["devices_per_node"], f"{key}.devices_per_node",
                                        integer=True),
                _number(entry["nodes"], f"{key}.nodes", integer=True), margin,
                None if price is None else _number(price, f"{key}.price_per_device_hour",
                                                   positive=False),
                {str(k): str(v) for k, v in labels.items()}, eff)


def parse_pools(data, key: str = "") -> tuple:
    """The `Pool` s of a pool file / ``hardware:`` section ``data`` (module docstring); ``key``:
    the prefix its keys are named with in errors (``hardware`` in a run file)."""
    pre = f"{key}." if key else ""
    data = _mapping(data, key or "pool file", "pools: and accelerators:")
    _unknown(data, _TOP_KEYS, key or "pool file")
    if not data.get("pools"):
        raise ValueError(f"{pre}pools: missing; declare at least one pool ({{name: {{accelerator: "
                         "h100, devices_per_node: 8, nodes: 1}}}}).")
    kinds = _own_kinds(data.get("accelerators") or {}, f"{pre}accelerators")
    pools = _mapping(data["pools"], f"{pre}pools", "pool names to their settings")
    return tuple(_pool(n, e, kinds, f"{pre}pools.{n}") for n, e in pools.items())


def load_pool_file(path: str) -> tuple:
    """`parse_pools` of the YAML file ``path``; errors name the file and the key."""
    import os

    import yaml

    if not os.path.isfile(path):
        raise ValueError(f"--pool {path}: no such file.")
    with open(path) as f:
        try:
            data = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ValueError(f"--pool {path}: not valid YAML: {e}") from None
    try:
        return parse_pools(data)
    except ValueError as e:
        raise ValueError(f"--pool {path}: {e}") from None
