"""The resetting chunked gated delta rule (`ray_dhp.models.delta_rule`) against transformers'
stock ``torch_chunk_gated_delta_rule`` run on each segment alone."""

import pytest
import torch

from ray_dhp.models.delta_rule import chunk_gated_delta_rule_with_resets
from ray_dhp.parallel.segments import segment_layout

CHUNK = 64


def _inputs(rows: int, width: int, seed: int = 0) -> list:
    """Random q, k ``[R, W, 2, 8]``, v ``[R, W, 4, 6]`` (grouped values), decay ``g <= 0`` and
    ``beta`` in (0, 1) ``[R, W, 4]``, fp64, leaf tensors. Every place is random, gaps included:
    the mixer's gap tokens are not zero after its conv, and must not matter."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(rows, width, 2, 8), (rows, width, 2, 8), (rows, width, 4, 6), (rows, width, 4), (rows, width, 4)]
    x = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in shapes]
    x[3] = -torch.nn.functional.softplus(x[3])
    x[4] = x[4].sigmoid()
    return [t.requires_grad_() for t in x]


def test_resets_equal_the_stock_recurrence_per_segment_fp64():
    """With the L2-normalised q and k the mixer asks for: rows of 200 packed tokens (segments of 70, 5, 64, 61 and 1, 130, 69 tokens: within a
    chunk, whole chunks, across chunks) in the aligned layout (64-token chunks, 3 zeros before
    each segment): each segment's outputs and the gradients of q, k, v, g and beta at its tokens
    equal the stock function's on the segment alone. Both compute in fp32 from fp64 inputs (the
    stock function casts to fp32 whatever it is given): the outputs are the same fp32
    operations on the same values, bit for bit (bound 1e-12, measured 0); the gradients run the
    same backward ops but the fp32 kernels' summation follows the tensors' sizes and layout (the
    stock function alone on 61 tokens or on them plus 3 zero tokens already differs by one fp32
    ulp in the key's gradient), so they agree to fp32 rounding: bound 1e-6 of the largest
    gradient (16 ulps of 2^-24), measured <= 2.4e-7 absolute on gradients of size ~10. The gap
    tokens' gradients are exactly zero: their state is reset before the next segment reads it.
    Negative control: without the resets the second segment of a row differs (beyond 1e-3)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule as stock

    cu = torch.tensor([0, 70, 75, 139, 200, 201, 331, 400])
    layout = segment_layout(cu, 200, align=CHUNK, gap=3)
    rows, width = layout.to_rows.shape
    inputs = _inputs(rows, width)
    out, _ = chunk_gated_delta_rule_with_resets(*inputs[:3], g=inputs[3], beta=inputs[4],
                                                starts=layout.starts, use_qk_l2norm_in_kernel=True)
    weight = torch.randn(out.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    real = (layout.to_rows < cu[-1]).to(out.dtype)[..., None, None]
    (out * weight * real).sum().backward()
    worst, worst_grad = 0.0, 0.0
    for r, start in layout.starts.nonzero().tolist():
        first = layout.to_rows[r, start]
        n = int(cu[1:][cu[:-1] == first]) - int(first)
        seg = [t.detach()[r:r + 1, start:start + n].clone().requires_grad_() for t in inputs]
        want, _ = stock(*seg[:3], g=seg[3], beta=seg[4], use_qk_l2norm_in_kernel=True)
        (want * weight[r:r + 1, start:start + n]).sum().backward()
        worst = max(worst, float((out[r:r + 1, start:start + n] - want).abs().max().detach()))
        for t, s in zip(inputs, seg):
            err = (t.grad[r:r + 1, start:start + n] - s.grad).abs().max() / t.grad.abs().max()
            worst_grad = max(worst_grad, float(err))
    assert worst <= 1e-12, worst
    assert worst_grad <= 1e-6, worst_grad
    gaps = layout.to_rows >= cu[-1]
    assert all(bool((t.grad[gaps] == 0).all()) for t in inputs)
    leaked, _ = chunk_gated_delta_rule_with_resets(*inputs[:3], g=inputs[3], beta=inputs[4],
                                                   starts=torch.zeros_like(layout.starts),
                                                   use_qk_l2norm_in_kernel=True)
    second = slice(CHUNK * 2, CHUNK * 2 + 5)  # row 0's 5-token segment
    assert layout.starts[0, CHUNK * 2]
    assert (leaked[0, second] - out[0, second]).abs().max() > 1e-3


def test_a_segment_inside_a_chunk_is_refused():
    starts = torch.zeros(1, 100, dtype=torch.bool)
    starts[0, [0, 10]] = True
    q, k, v, g, beta = _inputs(1, 100)
    with pytest.raises(ValueError, match="starts inside a 64-token chunk"):
        chunk_gated_delta_rule_with_resets(q, k, v, g=g, beta=beta, starts=starts)
