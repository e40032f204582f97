"""Benchmarks of ray_dhp against uniform TP, FSDP2 and DeepSpeed ZeRO-3 (see README.md)."""
