"""The placement-group cleaner ray_dhp launches (`ray_dhp.train.pg_cleaner`) decides whether the
controller lives from its own cluster's GCS (no state-API HTTP lookup that another Ray on the
machine could answer): alive while the watched actor lives, dead once it is killed. And
`ray_dhp.train.waiting.PlacementWatch` says what a run waits for while its placement group is
pending. (A whole run beside a neighbour cluster: tests/ray/test_shared_machine.py.)"""

import time

import ray

from ray_dhp.train.pg_cleaner import _ClusterCleaner, controller_alive
from ray_dhp.train.waiting import PlacementWatch


class _Probe(_ClusterCleaner):
    def alive(self, actor_id):
        from ray.train.v2._internal.execution.controller import placement_group_cleaner as mod

        return mod.is_actor_alive is controller_alive, mod.is_actor_alive(actor_id, timeout=5)


def test_the_cleaner_asks_its_own_gcs(ray_start):
    @ray.remote(num_cpus=0)
    class Watched:
        def id(self):
            return ray.get_runtime_context().get_actor_id()

    watched = Watched.remote()
    wid = ray.get(watched.id.remote())
    probe = ray.remote(num_cpus=0)(_Probe).remote(
        controller_actor_id="unused", check_interval_s=1.0, get_actor_timeout_s=30, stop_timeout=5)
    assert ray.get(probe.alive.remote(wid)) == (True, True)
    ray.kill(watched)
    deadline = time.monotonic() + 30
    while ray.get(probe.alive.remote(wid))[1] and time.monotonic() < deadline:
        time.sleep(0.2)
    assert ray.get(probe.alive.remote(wid)) == (True, False)
    ray.kill(probe)


def test_a_pending_placement_is_said_with_what_is_free(ray_start):
    free = int(ray.available_resources().get("CPU", 0))
    want = [{"CPU": 1}] * (free + 1)  # one bundle more than the cluster has free
    said = []
    with PlacementWatch(want, timeout_s=600, every_s=0.5, say=said.append):
        pg = ray.util.placement_group(want)
        deadline = time.monotonic() + 30
        while not said and time.monotonic() < deadline:
            time.sleep(0.2)
    ray.util.remove_placement_group(pg)
    assert said, "nothing said while the placement group was pending"
    assert f"{free + 1} bundles of {{'CPU': 1}}" in said[0]
    assert f"CPU {free:g} free of" in said[0] and "placement_timeout_s=600" in said[0]
