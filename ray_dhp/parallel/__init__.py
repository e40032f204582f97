"""The rank topology and its process groups (`Topology`, `DHPGroups`), and the parallelism
mechanisms, generic over model families (plans live in ray_dhp.models)."""
