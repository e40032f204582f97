"""The placement-group cleaner ray_dhp launches (`ray_dhp.train.pg_cleaner`) asks the state API
of the cluster it runs in: its process's RAY_ADDRESS is this cluster's GCS, so the address the
state API resolves is this cluster's dashboard and the controller it watches is found there.
(Ray's own cleaner resolves "the" cluster from the machine: beside another Ray instance that
printed "Found multiple active Ray instances" and, with a stale `ray start` address file, the
"Timed out while waiting for GCS" traceback.)"""

import ray

from ray_dhp.train.pg_cleaner import _ClusterCleaner


class _Probe(_ClusterCleaner):
    def where(self, actor_id):
        import os

        from ray.dashboard.utils import get_address_for_submission_client
        from ray.train.v2._internal.state.util import is_actor_alive

        return (os.environ.get("RAY_ADDRESS"), get_address_for_submission_client(None),
                bool(is_actor_alive(actor_id, timeout=30)))


def test_the_cleaner_asks_its_own_cluster(ray_start):
    @ray.remote(num_cpus=0)
    class Watched:
        def id(self):
            return ray.get_runtime_context().get_actor_id()

    watched = Watched.remote()
    probe = ray.remote(num_cpus=0)(_Probe).remote(
        controller_actor_id="unused", check_interval_s=1.0, get_actor_timeout_s=30, stop_timeout=5)
    address, api, alive = ray.get(probe.where.remote(ray.get(watched.id.remote())))
    assert address == ray.get_runtime_context().gcs_address
    from ray.dashboard.utils import ray_address_to_api_server_url

    assert api == ray_address_to_api_server_url(address) and alive
    ray.kill(probe)
    ray.kill(watched)
