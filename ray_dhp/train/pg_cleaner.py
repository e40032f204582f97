"""Ray Train's placement-group cleaner, asking its own cluster's GCS whether the controller lives.

Ray Train V2 starts a detached ``PlacementGroupCleaner`` actor per run. Its monitor thread asks
every second whether the run's controller is alive and, when the answer is "dead", removes the
run's placement group (so a driver that died cannot leak it). Ray 2.60 asks through the *state
API*, an HTTP client of the dashboard, and treats "not found" as dead. The HTTP address comes
from the GCS key the head node wrote at start-up, and a cluster started without a dashboard
still records ``127.0.0.1:8265`` there. So:

- beside another Ray instance on the same machine whose dashboard holds :8265, the cleaner of a
  dashboard-less cluster asks the *other* cluster, which does not know our controller: "dead".
  The cleaner removes the live run's placement group and Ray destroys its workers ("A worker
  health check failed"; the controller log says "Detected that the Ray Train controller actor
  ... is dead"). Started in the other order the run survives (docs/faq.md has the report);
- before such a neighbour exists, every check fails ("Failed to connect to API server") and the
  cleaner would never clean anything.

`ClusterCleanerCallback` replaces Ray's callback (`DisaggregatedTrainer` swaps it in): the same
cleaner, but its liveness check reads the actor table of the GCS this actor process is connected
to (the run's own cluster: the connection Ray made when it started the actor, no address lookup,
no HTTP, no dashboard), so no other Ray on the machine can answer for it.
"""

from __future__ import annotations


from ray.train.v2._internal.callbacks import placement_group_callback as _pgc
from ray.train.v2._internal.execution.controller import placement_group_cleaner as _cleaner_mod

__all__ = ["ClusterCleanerCallback", "with_cluster_cleaner", "controller_alive"]



def controller_alive(actor_id: str, timeout=None) -> bool:
    """Whether ``actor_id`` is alive, from the actor table of the GCS this process is connected
    to (`ray._private.state`: a direct GCS read). "Not found" is dead there too, but only our own
    cluster can say it. A failed read raises Ray's ``RayStateApiException`` so the cleaner keeps
    monitoring (its own rule for an unavailable state API) instead of cleaning on a guess.
    ``timeout`` is accepted for the signature of Ray's ``is_actor_alive`` and not needed: the
    read goes to the local GCS client, not over HTTP."""
    import ray._private.state as gcs_state
    from ray.util.state.exception import RayStateApiException

    try:
        info = gcs_state.actors(actor_id=actor_id)
    except Exception as e:  # a GCS hiccup: say "unknown", never "dead"
        raise RayStateApiException(f"reading actor {actor_id} from this cluster's GCS: {e}") from e
    return bool(info) and info.get("State") != "DEAD"


class _ClusterCleaner(_cleaner_mod.PlacementGroupCleaner):
    """`PlacementGroupCleaner` whose liveness checks read this cluster's GCS (`controller_alive`).

    The cleaner's monitor loop calls its module's ``is_actor_alive``; this actor has a process of
    its own, so pointing that name at `controller_alive` here changes nothing anywhere else."""

    def __init__(self, *args, **kwargs):
        _cleaner_mod.is_actor_alive = controller_alive
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
