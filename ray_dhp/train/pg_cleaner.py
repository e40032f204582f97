"""Ray Train's placement-group cleaner, asking the cluster it runs in.

Ray Train V2 starts a detached ``PlacementGroupCleaner`` actor per run. Its monitor thread asks
the state API every second whether the controller is alive, with no address: the state API then
takes ``RAY_ADDRESS``, else the address file of the last ``ray start`` on the machine, else every
``gcs_server`` process it finds. Beside another Ray instance on the same machine (a ``ray
start`` cluster, another job's private Ray) that raises "Found multiple active Ray instances"
mid-run, or, when the address file names a cluster that is gone, "Timed out while waiting for
GCS to become available" (the ~30-line traceback after ``[ray_dhp] done``); a file naming a live
other cluster even has the cleaner look for our controller there.

`ClusterCleanerCallback` replaces Ray's callback (`DisaggregatedTrainer` swaps it in): the same
cleaner, with ``RAY_ADDRESS`` set in its own process to the GCS address of the cluster it runs
in, so each state-API call reaches this cluster and no other.
"""

from __future__ import annotations

import os

from ray.train.v2._internal.callbacks import placement_group_callback as _pgc
from ray.train.v2._internal.execution.controller.placement_group_cleaner import PlacementGroupCleaner

__all__ = ["ClusterCleanerCallback", "with_cluster_cleaner"]


class _ClusterCleaner(PlacementGroupCleaner):
    """`PlacementGroupCleaner` whose state-API calls go to the cluster it runs in."""

    def __init__(self, *args, **kwargs):
        import ray

        os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address  # this actor's process
        super().__init__(*args, **kwargs)


class ClusterCleanerCallback(_pgc.PlacementGroupCleanerCallback):
    """Ray Train's `PlacementGroupCleanerCallback`, launching `_ClusterCleaner` (runs in the
    controller process: the module's cleaner class is swapped there, nowhere else)."""

    def after_controller_start(self, train_run_context):
        _pgc.PlacementGroupCleaner = _ClusterCleaner
        super().after_controller_start(train_run_context)


def with_cluster_cleaner(callbacks: list) -> list:
    """``callbacks`` with Ray's placement-group cleaner callback replaced by ours."""
    return [ClusterCleanerCallback() if type(c) is _pgc.PlacementGroupCleanerCallback else c
            for c in callbacks]
