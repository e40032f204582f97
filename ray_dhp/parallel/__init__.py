"""Parallelism mechanisms, generic over model families (plans live in ray_dhp.models)."""
