"""What one rank holds at start-up, computed on the meta device (no weights, no devices).

`meta_engine` builds the real `DHPEngine` of one rank of a layout — the same meta
construction, module selection and DTensor tensor-parallel plan a training run uses — with the
``meta`` device and a *fake* process group (``torch.testing``'s ``FakeStore``: collectives are
no-ops), so a 32B layout of 8 ranks is inspected on a laptop in seconds. `rank_parameter_bytes`
reports the local parameter bytes of that rank: what the engine materialises on its device.

Example::

    >>> from ray_dhp.planning.startup import rank_parameter_bytes
    >>> from ray_dhp.parallel.topology import Topology
    >>> topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=8, text_dp=1, text_tp=8)
    >>> rank_parameter_bytes(config_32b, topo, rank=0)   # doctest: +SKIP
    {'vision': 2755330560, 'text': 16384288768, 'total': 19139619328}
"""

from __future__ import annotations

import contextlib

import torch

__all__ = ["meta_engine", "rank_parameter_bytes"]


@contextlib.contextmanager
def _fake_world(rank: int, world_size: int):
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("meta_engine needs a process without torch.distributed initialised "
                           "(it sets up a fake process group of the layout's world size)")
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _meta_groups(topology, rank: int):
    """The groups the engine reads at construction: roles and the text ("dp", "tp") mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    from ray_dhp.parallel.mesh import DHPGroups, EncoderGroups

    groups = DHPGroups(topology=topology, rank=rank, device=torch.device("meta"))
    for m in topology.encoders:  # the encoders this rank hosts (no process groups on meta)
        if groups.hosts(m.name):
            groups.encoders[m.name] = EncoderGroups()
    if groups.is_text:
        groups.text_mesh = DeviceMesh("cpu", torch.tensor(topology.text.mesh()),
                                      mesh_dim_names=("dp", "tp"))
    return groups


def meta_engine(model, topology, rank: int, cfg=None, dtype: torch.dtype = torch.float32):
    """The `DHPEngine` of ``rank`` in ``topology`` built on the meta device (see module doc).

    Args:
        model: a transformers config or a local model directory (only its config and
            safetensors headers are read).
        topology: the `ray_dhp.parallel.topology.Topology` of the run.
        rank: the world rank to build.
        cfg: what the engine reads (`ray_dhp.config.views.StepConfig`; default: the defaults).
        dtype: the weight dtype.
    """
    from ray_dhp.config.views import StepConfig
    from ray_dhp.step.engine import DHPEngine

    cfg = cfg or StepConfig()
    with _fake_world(rank, topology.world_size):
        return DHPEngine(model, _meta_groups(topology, rank), cfg, dtype=dtype)


def rank_parameter_bytes(model, topology, rank: int, dtype: torch.dtype = torch.float32) -> dict:
    """Local parameter bytes of ``rank``: ``{"vision", "text", "total"}`` (DTensors count their
    local shard; the vision tower is whole on every vision rank)."""
    from ray_dhp.models.loading import local_parameter_bytes

    engine = meta_engine(model, topology, rank, dtype=dtype)
    vision = local_parameter_bytes(engine.visual)
    text = local_parameter_bytes(engine.text_model)
    return {"vision": vision, "text": text, "total": vision + text}
