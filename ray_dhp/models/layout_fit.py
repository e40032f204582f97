"""Whether a layout fits a model: `check_layout_fits`, the one check of a layout's degrees
against the model's dimensions and the family's coverage.

`ray_dhp.layout.DHPConfig` calls it as it is built (so the driver refuses a layout before any
worker starts: ``ray-dhp plan`` / ``config`` / ``train`` and `DisaggregatedTrainer` alike); the
engine trusts the topology it is given.
"""

from __future__ import annotations

__all__ = ["check_layout_fits", "check_encoders"]


def check_layout_fits(family, config, topology, *, packing: bool = False) -> None:
    """ValueError, saying what to change, for the first degree of ``topology`` (a
    `ray_dhp.parallel.topology.Topology`) the model ``config`` of ``family`` cannot take: the
    Ulysses and tensor degrees against the heads and widths, expert parallelism against the
    experts, each encoder group against the family's encoders, context parallelism and expert
    tensor parallelism against what the family covers."""
    from ray_dhp.parallel.context import refusal

    family.validate_layout(config, sp=topology.vision.inner, tp=topology.text.inner,
                           text_sp=topology.text_sequence_parallel, packing=packing)
    family.validate_expert_parallel(config, topology.text_expert_parallel)
    check_encoders(family, topology)
    why = refusal(family, config, topology.text.cp, topology.text.inner,
                  tuple(family.encoder_spec(m.name).operations() for m in topology.encoders),
                  text_sp=topology.text_sequence_parallel)
    if why:
        raise ValueError(why)
    if topology.text_expert_tp:
        from ray_dhp.parallel.expert_tp import validate

        validate(family, config, topology.text.inner)


def check_encoders(family, topology) -> None:
    """ValueError naming the run-file section for an encoder the layout cannot take: one the
    family does not have, Ulysses where its operations have none, ZeRO-3 where they refuse it."""
    for m in topology.encoders:
        spec = family.encoder_spec(m.name)
        if spec is None:
            have = [e.name for e in family.encoders]
            raise ValueError(f"{m.name}: the {family.name} family has no {m.name} encoder "
                             f"(its encoders besides vision: {have or 'none'}); drop the "
                             f"'{m.name}:' section.")
        ops = spec.operations()
        if m.inner > 1 and not ops.SEQUENCE_PARALLEL:
            raise ValueError(f"{m.name}.sequence_parallel={m.inner}: the {m.name} encoder trains "
                             f"data parallel only; set {m.name}.sequence_parallel=1.")
        refusal = ops.zero3_refusal(family) if m.zero_stage == 3 else None
        if refusal:
            raise ValueError(refusal)
