"""What each rank reads and holds when the engine builds from a checkpoint directory, the body
`test_sharded_loading.py` and `test_moe_loading.py` share: every tensor read through a
``safetensors`` handle is recorded, and every parameter the rank holds is returned with its
placements and the bytes it occupies."""

import torch

from ray_dhp.config.train_loop import TrainLoopConfig


def _probe_reads() -> list:
    """Instrument ``safetensors.safe_open`` in this process: every tensor read from a handle
    (``get_tensor``, or ``get_slice(...)[...]``) is recorded as ``(key, how, bytes read)``."""
    import safetensors

    reads, stock = [], safetensors.safe_open

    class Slice:
        def __init__(self, inner, key):
            self.inner, self.key = inner, key

        def __getattr__(self, attr):  # get_shape, get_dtype: header only
            return getattr(self.inner, attr)

        def __getitem__(self, index):
            t = self.inner[index]
            reads.append((self.key, "get_slice", t.numel() * t.element_size()))
            return t

    class Handle:
        def __init__(self, *a, **k):
            self.inner = stock(*a, **k)

        def __enter__(self):
            self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def __getattr__(self, attr):
            return getattr(self.inner, attr)

        def get_tensor(self, key):
            t = self.inner.get_tensor(key)
            reads.append((key, "get_tensor", t.numel() * t.element_size()))
            return t

        def get_slice(self, key):
            return Slice(self.inner.get_slice(key), key)

    safetensors.safe_open = Handle
    return reads


def _holdings_body(rank, world, layout, model):
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups
    from ray_dhp.models.loading import local_parameter_bytes
    from ray_dhp.parallel.tensor import local
    from ray_dhp.parallel.topology import Topology

    reads = _probe_reads()
    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(model, groups, TrainLoopConfig(global_batch_size=2, seed=5).step_config())
    held = {}
    for prefix, mod in (("model.visual.", engine.visual), ("", engine.text_model)):
        for n, p in (mod.named_parameters() if mod is not None else []):
            placements = [pl.dim if pl.is_shard() else None for pl in getattr(p, "placements", ())]
            held[prefix + n] = (local(p).detach().clone(), tuple(p.shape), placements, p.is_meta)
    return {"held": held, "bytes": local_parameter_bytes(engine.visual, engine.text_model), "reads": reads,
            "is_vision": groups.is_vision, "is_text": groups.is_text, "tp": groups.text_coord}
