"""The benchmarks' launcher is the library's local spawner (`ray_dhp.launch`)."""

from ray_dhp.launch import free_port, spawn  # noqa: F401
