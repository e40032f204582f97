"""The Gated DeltaNet recurrence in fp64 on both sides of a packed-rows exactness test."""

import torch


def fp64_delta_rule():
    """Both sides of an fp64 exactness test of packed Gated DeltaNet rows (a ``prepare`` of
    `run_engine` and `shared_reference`): transformers' torch recurrence computes in fp32 whatever
    its inputs, and its fp32 backward rounds by the tensors' layout (packed rows move a segment
    to other rows and chunks: ~1e-8 relative gradient error, `ray_dhp.models.delta_rule`); here
    the stock recurrence is `chunk_gated_delta_rule_with_resets` without resets (equal to it per
    segment, tests/unit/test_delta_rule.py) and both compute in fp64. Returns the undo."""
    import importlib

    from ray_dhp.models import delta_rule

    saved = [(delta_rule, "COMPUTE_DTYPE", delta_rule.COMPUTE_DTYPE)]
    delta_rule.COMPUTE_DTYPE = torch.float64
    for name in ("qwen3_5", "qwen3_5_moe"):
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        saved.append((module, "torch_chunk_gated_delta_rule", module.torch_chunk_gated_delta_rule))
        module.torch_chunk_gated_delta_rule = delta_rule.chunk_gated_delta_rule_with_resets

    def undo():
        for owner, attr, value in saved:
            setattr(owner, attr, value)

    return undo
