"""Say what a run waits for while Ray cannot place its workers (driver side).

Ray Train waits for the worker group's placement group quietly ("Attempting to start training
worker group ..." and then nothing). `PlacementWatch` runs beside ``fit()`` in the driver: while
a placement group with this run's bundles, created after ``fit()`` began, is still PENDING, it
prints every ``every_s`` seconds what is wanted and what the cluster has free, e.g.

    [ray_dhp] waiting 30 s for room to place the workers: 4 bundles of {'CPU': 1} (CPU 4 in
    all); the cluster has CPU 2 free of 8 (other runs hold the rest); the run gives up after
    placement_timeout_s=600 s

The total wait is bounded by ``placement_timeout_s`` (`ray_dhp.train.cluster.bound_placement_retries`).
Only the GCS of the connected cluster is read (``ray.util.placement_group_table``).
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

__all__ = ["PlacementWatch", "waiting_message"]


def _pending_pgs(bundles: list, known: set) -> list:
    import ray

    table = ray.util.placement_group_table()
    want = sorted(sorted(b.items()) for b in bundles)
    out = []
    for pg_id, pg in table.items():
        if pg_id in known or pg.get("state") != "PENDING":
            continue
        have = sorted(sorted((k, float(v)) for k, v in b.items())
                      for b in (pg.get("bundles") or {}).values())
        if have == sorted(sorted((k, float(v)) for k, v in b) for b in want):
            out.append(pg_id)
    return out


def waiting_message(bundles: list, waited_s: float, free: dict, total: dict,
                    timeout_s: Optional[float]) -> str:
    """One line: what the run waits for, what is free (of each resource the bundles ask)."""
    need = {}
    for b in bundles:
        for k, v in b.items():
            need[k] = need.get(k, 0) + v
    shapes = sorted({tuple(sorted(b.items())) for b in bundles})
    shape = ", ".join(str(dict(s)) for s in shapes)
    wanted = ", ".join(f"{k} {v:g}" for k, v in sorted(need.items()))
    have = ", ".join(f"{k} {free.get(k, 0):g} free of {total.get(k, 0):g}" for k in sorted(need))
    short = [k for k, v in need.items() if free.get(k, 0) < v]
    why = (" (other runs hold the rest)" if short and all(total.get(k, 0) >= need[k] for k in short)
           else " (the cluster is smaller than the layout: add nodes or lower the worker count)"
           if short else "")
    limit = (f"; the run gives up after placement_timeout_s={timeout_s:g} s" if timeout_s
             else "; placement_timeout_s=None: it waits until room appears")
    return (f"[ray_dhp] waiting {waited_s:.0f} s for room to place the workers: {len(bundles)} "
            f"bundles of {shape} ({wanted} in all); the cluster has {have}{why}{limit}")


class PlacementWatch:
    """Print `waiting_message` every ``every_s`` while this run's placement group is pending.

    Use as a context manager around ``fit()``; placement groups that existed before it are not
    this run's and are ignored."""

    def __init__(self, bundles: list, timeout_s: Optional[float], every_s: float = 30.0,
                 say: Callable[[str], None] = lambda m: print(m, flush=True)):
        self.bundles, self.timeout_s, self.every_s, self.say = bundles, timeout_s, every_s, say
        self._stop = threading.Event()
        self._known: set = set()
        self._thread: Optional[threading.Thread] = None
        self.messages: list = []

    def __enter__(self):
        import ray

        self._known = set(ray.util.placement_group_table())
        self._start = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="ray_dhp-placement-watch",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        return False

    def _run(self) -> None:
        import ray

        while not self._stop.wait(self.every_s):
            try:
                if not _pending_pgs(self.bundles, self._known):
                    continue
                msg = waiting_message(self.bundles, time.monotonic() - self._start,
                                      ray.available_resources(), ray.cluster_resources(),
                                      self.timeout_s)
            except Exception:  # the watch only informs: never let it disturb the run
                continue
            self.messages.append(msg)
            self.say(msg)
