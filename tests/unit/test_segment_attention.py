"""One attention call per ViT block: the batched (padded + masked) segment attention equals the
per-segment loop in fp64, outputs and q/k/v gradients, for equal windows, ragged windows (one
padded call) and very different segment lengths (one call per length)."""

from __future__ import annotations

import pytest
import torch

from ray_dhp.parallel.ulysses import _length_groups, _segment_attention, segment_index


class _Attn(torch.nn.Module):
    def __init__(self, impl: str, hd: int):
        super().__init__()
        import transformers

        self.config = transformers.PretrainedConfig()
        self.config._attn_implementation = impl
        self.scaling, self.attention_dropout, self.num_key_value_groups = hd ** -0.5, 0.0, 1


# the module the eager fallback and rotary are looked up in (like a real Qwen2-VL attention)
import transformers.models.qwen2_vl.modeling_qwen2_vl  # noqa: E402,F401

_Attn.__module__ = "transformers.models.qwen2_vl.modeling_qwen2_vl"


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("lengths", [[16, 16, 16], [16, 12, 16, 4, 9], [64, 3, 3, 5], [7]])
def test_batched_equals_loop_fp64(impl, lengths):
    h, hd = 2, 8
    g = torch.Generator().manual_seed(0)
    qkv = [torch.randn(sum(lengths), h, hd, generator=g, dtype=torch.float64, requires_grad=True)
           for _ in range(3)]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    attn = _Attn(impl, hd)
    w = torch.randn(sum(lengths), h, hd, generator=g, dtype=torch.float64)
    results = []
    for batched in (False, True):
        out = _segment_attention(attn, *qkv, cu, batched=batched)
        grads = torch.autograd.grad((out * w).sum(), qkv)
        results.append((out.detach(), grads))
    (o0, g0), (o1, g1) = results
    # sdpa stays in fp64 (sum order is the only difference: ~1e-16). transformers' eager takes the
    # softmax in fp32 even for fp64 inputs, and its vectorised row sums differ with the row length
    # (padded vs not): ~1e-7, so 1e-5 there; a wrong segment or mask is O(1) either way.
    tol = 1e-12 if impl == "sdpa" else 1e-5
    torch.testing.assert_close(o1, o0, rtol=tol, atol=tol)
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


def test_grouping_and_index():
    assert _length_groups([64, 64, 40], 2.0) == [[0, 1, 2]]  # windows: one call
    assert _length_groups([1024, 16, 16], 2.0) == [[0], [1, 2]]  # big + small images: per length
    idx, valid = segment_index([3, 1])
    assert idx.tolist() == [[0, 1, 2], [3, 0, 0]] and valid.tolist() == [[True] * 3, [True, False, False]]
