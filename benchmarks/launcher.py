"""The benchmarks' launcher is the library's local spawner (`ray_dhp.train.launch`)."""

from ray_dhp.train.launch import free_port, spawn  # noqa: F401
