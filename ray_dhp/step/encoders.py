"""Checks on the encoder modules a layout gives their own groups (`Topology.encoders`).

The vision side is every family's first encoder; any other (Qwen2.5-Omni's audio tower) must be
one the family has (`FamilySpec.encoders`), and is covered data parallel at ZeRO stages 0-2.
"""

from __future__ import annotations


def check_encoders(family, topology) -> None:
    """ValueError naming the run-file section for an encoder the layout cannot take."""
    for m in topology.encoders:
        if m.name == "vision":
            continue
        if family.encoder_spec(m.name) is None:
            have = [e.name for e in family.encoders]
            raise ValueError(f"{m.name}: the {family.name} family has no {m.name} encoder "
                             f"(its encoders besides vision: {have or 'none'}); drop the "
                             f"'{m.name}:' section.")
        if m.inner > 1:
            raise ValueError(f"{m.name}.sequence_parallel={m.inner}: the {m.name} encoder trains "
                             f"data parallel only; set {m.name}.sequence_parallel=1.")
        if m.zero_stage == 3:
            raise ValueError(f"{m.name}.zero_stage=3 is not covered for the {m.name} encoder; use "
                             f"{m.name}.zero_stage 0-2.")
