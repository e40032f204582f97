"""The vision side (tower + projector) as an encoder module: its `EncoderSpec` operations, the
same interface as the audio tower's (`ray_dhp.models.audio_omni`), answered from the family's
vision fields (`FamilySpec.vision_module`, ``vision_parts``, ``merge_size``, ...).

A sample's rows are the merged patch rows of its images and videos (one per image/video pad, items
in placeholder order). A replica's rows are split over its SP ranks by the family's plan
(`FamilySpec.plan_vision`: window-aligned for the Qwen towers, by tiles for InternViT), and at
ZeRO-3 the tower is FSDP2-sharded over the whole vision group (`ray_dhp.models.fsdp_vision`). The
text shard holds no vision part: the rows go in through the model's own ``mm_encoder_outputs``
(`FamilySpec.encoder_outputs`, split into the image and the video outputs by `row_modalities`).
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SEQUENCE_PARALLEL", "CONTEXT_PARALLEL", "row_tokens", "dim", "has_input", "rows", "cost", "plan", "local_rows", "inputs",
           "forward", "install_slot", "text_inputs", "zero3_refusal", "shard", "item_kinds",
           "row_modalities", "item_rows"]

SEQUENCE_PARALLEL = True  # Ulysses over the tower's attention heads
CONTEXT_PARALLEL = True  # its rows follow their placeholder tokens (`row_tokens`): sliceable


def row_tokens(sample) -> torch.Tensor:
    """``[L]`` bool: the tokens of ``sample`` that take one of its rows (image and video pads,
    in the rows' order), for the LM's context parallelism (`ray_dhp.parallel.context.local_rows`)."""
    return (sample.mm_token_type_ids == 1) | (sample.mm_token_type_ids == 2)


def dim(family, config) -> int:
    """Width of one merged row as it crosses the boundary (deepstack concatenated)."""
    return family.feature_dim(config)


def has_input(sample) -> bool:
    return sample.image_grid_thw is not None


def rows(family, config, sample) -> int:
    """Merged rows of ``sample``'s images and videos."""
    if sample.image_grid_thw is None:
        return 0
    return int(item_rows(sample, family.merge_size(config)).sum())


def item_rows(sample, merge: int) -> torch.LongTensor:
    """``[items]`` feature rows of each of ``sample``'s images and videos: the processor's count
    where the sample carries one (``item_rows``: an anyres image's rows depend on its original
    size), else ``t*h*w / merge**2`` of its grid."""
    if getattr(sample, "item_rows", None) is not None:
        return sample.item_rows
    return sample.image_grid_thw.prod(-1) // (merge * merge)


def cost(sample, model) -> int:
    """Balancing cost of ``sample`` on the vision side: the cost model's FLOPs of its items."""
    return model.vision(sample.image_grid_thw)


def plan(family, config, samples, sp: int, micro_batch=None):
    """The SP split of one replica's images and videos (None: it has none; each image's rows
    depend on it alone: ``micro_batch`` plays no part)."""
    mine = [s for s in samples if s.image_grid_thw is not None]
    if not mine:
        return None
    items = {}
    if any(getattr(s, "image_sizes", None) is not None for s in mine):  # anyres images
        merge = family.merge_size(config)
        items = {"image_sizes": torch.cat([s.image_sizes for s in mine]),
                 "item_rows": torch.cat([item_rows(s, merge) for s in mine])}
    return family.plan_vision(config, torch.cat([s.image_grid_thw for s in mine]), sp, **items)


def local_rows(plan, sp_rank: int, rows: torch.Tensor) -> torch.Tensor:
    """The replica's ``rows`` SP rank ``sp_rank`` computes, in its local order (its cut of the
    plan's processing order)."""
    return rows[plan.order[plan.cuts[sp_rank]:plan.cuts[sp_rank + 1]]]


def inputs(samples) -> dict:
    """The pixel rows of ``samples`` (those with images or videos), concatenated in order."""
    if any(s.pixel_values is None for s in samples):
        raise RuntimeError("a sample this vision replica computes has no pixels here: the "
                           "loader routed them by another balance than the engine's (give "
                           "StepLoader the engine's balancer)")
    return {"pixel_values": torch.cat([s.pixel_values for s in samples])}


def forward(family, module, inputs: dict, plan, dtype: torch.dtype, *, sp_rank: int = 0,
            sp_group=None, comm=None, sharded=None) -> torch.Tensor:
    """SP rank ``sp_rank``'s merged rows ``[rows_local, dim]`` of the replica's images
    (`FamilySpec.vision_forward`; at ZeRO-3 the FSDP root's forward, `VisionStage3.forward`)."""
    pv = inputs["pixel_values"].to(dtype)
    if sharded is not None:
        return sharded.forward(pv, plan, sp_rank, sp_group, comm=comm)
    return family.vision_forward(module, pv, plan, sp_rank, sp_group, comm=comm)


def install_slot(family, model) -> None:
    """Detach the vision parts from ``model`` (a text shard takes the rows through
    ``mm_encoder_outputs``, so it needs no stand-in)."""
    owner = family.vision_owner(model)
    for p in family.vision_parts:
        setattr(owner, p, None)


def text_inputs(family, config, model, samples, feats: torch.Tensor, device,
                rows: Optional[torch.Tensor] = None) -> dict:
    """``mm_encoder_outputs`` of the rows ``feats`` of ``samples`` (images and videos apart);
    ``rows``: which of the samples' rows ``feats`` holds (a CP rank's slice), None: all."""
    modalities = row_modalities(samples, family.merge_size(config))
    if rows is not None:
        modalities = modalities[rows]
    return {"mm_encoder_outputs": family.encoder_outputs(config, feats, modalities)}


def zero3_refusal(family) -> Optional[str]:
    if family.vision_zero3:
        return None
    return (f"vision.zero_stage=3 is not covered for the {family.name} family (its tower is not "
            "split into FSDP units); use vision.zero_stage<=2.")


def shard(family, module, mesh, reduce_dtype, dtype, device):
    """ZeRO stage 3 of the tower over the vision group's ``mesh`` (`VisionStage3`)."""
    from ray_dhp.models.fsdp_vision import VisionStage3

    return VisionStage3(family.name, module, mesh, reduce_dtype, dtype, device)


# -- rows by modality --------------------------------------------------------------------------

def item_kinds(sample) -> list:
    """1 (image) or 2 (video) per visual item of ``sample``, in placeholder order."""
    n = 0 if sample.image_grid_thw is None else sample.image_grid_thw.shape[0]
    return [1] * n if sample.modalities is None else sample.modalities.tolist()


def row_modalities(samples, merge: int) -> torch.LongTensor:
    """``[rows]``: 1 (image) or 2 (video) for every merged vision row of ``samples``, in the
    order the boundary delivers them (sample by sample, items in placeholder order)."""
    out = []
    for s in samples:
        if s.image_grid_thw is not None:
            for k, n in zip(item_kinds(s), item_rows(s, merge).tolist()):
                out.append(torch.full((n,), k, dtype=torch.long))
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.long)
