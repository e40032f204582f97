"""The chunked gated delta rule's scan over chunks, two ways (issue #43): ``indexed`` takes chunk
``i`` of each tensor by indexing (``x[:, :, i]``) and writes its output into a preallocated tensor,
as transformers' torch recurrence does (and `ray_dhp.models.delta_rule` did before); ``unbind``
is `ray_dhp.models.delta_rule.scan_chunks` (one ``unbind`` per tensor, the outputs stacked once).
The per-chunk arithmetic is the same, so both give the same outputs and gradients bit for bit
(checked here, fp32 and fp64); what differs is the backward: each indexed chunk's gradient is a
full-size zero tensor with one chunk filled, O(chunks²) work on a row of many chunks.

Per shape (``[rows, tokens]``, key/value heads, head dims), forward + backward of
`chunk_gated_delta_rule_with_resets` (a segment starting every 256 tokens), one thread, the
contenders in turn ``--repeat`` times, each its quickest. Nothing here asserts.

Run: ``python -m benchmarks.delta_rule_scan [--repeat 5]``; writes
``benchmarks/results/delta-rule-scan-<hw>-<date>.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

# (name, rows, tokens, key heads, value heads, key dim, value dim)
SHAPES = (
    ("packed rows, demo width", 2, 2240, 4, 8, 8, 8),
    ("packed rows, tiny-wide", 2, 2240, 4, 8, 32, 32),
    ("packed rows, 64-dim heads", 2, 2240, 8, 16, 64, 64),
    ("padded group, demo width", 8, 320, 4, 8, 8, 8),
)


def scan_indexed(state, keep, new_values, k_cumdecay, query, intra, chunk_decay, key):
    """The scan as transformers' torch recurrence writes it: chunk ``i`` by indexing, its output
    into a preallocated tensor (the contender `scan_chunks` replaced)."""
    import torch

    out = torch.zeros_like(new_values)
    for i in range(query.shape[2]):
        state = state * keep[:, i, None, None, None]
        v_new = new_values[:, :, i] - k_cumdecay[:, :, i] @ state
        out[:, :, i] = query[:, :, i] @ state + intra[:, :, i] @ v_new
        state = state * chunk_decay[:, :, i] + key[:, :, i].transpose(-1, -2) @ v_new
    return out, state


def _inputs(rows, tokens, hk, hv, dk, dv, dtype):
    import torch

    g = torch.Generator().manual_seed(0)
    leaf = lambda *s: torch.randn(*s, dtype=dtype, generator=g).requires_grad_()  # noqa: E731
    decay = (-torch.rand(rows, tokens, hv, dtype=dtype, generator=g)).requires_grad_()
    beta = torch.rand(rows, tokens, hv, dtype=dtype, generator=g).requires_grad_()
    starts = torch.zeros(rows, tokens, dtype=torch.bool)
    starts[:, ::256] = True
    return leaf(rows, tokens, hk, dk), leaf(rows, tokens, hk, dk), leaf(rows, tokens, hv, dv), decay, beta, starts


def _run(scan, xs):
    import torch

    from ray_dhp.models import delta_rule

    q, k, v, g, beta, starts = xs
    stock, delta_rule.scan_chunks = delta_rule.scan_chunks, scan
    try:
        out, _ = delta_rule.chunk_gated_delta_rule_with_resets(q, k, v, g, beta, starts=starts,
                                                               use_qk_l2norm_in_kernel=True)
        weights = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)
        grads = torch.autograd.grad((out * weights).sum(), (q, k, v, g, beta))
    finally:
        delta_rule.scan_chunks = stock
    return out, grads


def run(repeat: int) -> dict:
    import torch

    from ray_dhp.models import delta_rule

    torch.set_num_threads(1)
    contenders = {"indexed": scan_indexed, "unbind": delta_rule.scan_chunks}
    stock_dtype = delta_rule.COMPUTE_DTYPE
    same = {}
    for dtype in (torch.float64, torch.float32):  # bit for bit, both precisions
        delta_rule.COMPUTE_DTYPE = dtype
        xs = _inputs(*SHAPES[0][1:], dtype)
        a, b = (_run(c, xs) for c in contenders.values())
        same[str(dtype)] = torch.equal(a[0], b[0]) and all(torch.equal(x, y) for x, y in zip(a[1], b[1]))
    delta_rule.COMPUTE_DTYPE = stock_dtype
    out = {"repeat": repeat, "bitwise_equal": same, "shapes": []}
    for name, *shape in SHAPES:
        xs = _inputs(*shape, torch.float32)
        best = {c: float("inf") for c in contenders}
        for _ in range(repeat):
            for c, scan in contenders.items():
                t0 = time.perf_counter()
                _run(scan, xs)
                best[c] = min(best[c], time.perf_counter() - t0)
        row = {"name": name, "shape": shape, "chunks": -(-shape[1] // 64), "seconds": best,
               "speedup": best["indexed"] / best["unbind"]}
        out["shapes"].append(row)
        print(f"[delta_rule_scan] {name:28s} {shape} indexed {best['indexed']:.4f}s  unbind "
              f"{best['unbind']:.4f}s  {row['speedup']:.2f}x", flush=True)
    return out


def plot(res: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["name"] for r in res["shapes"]]
    fig, ax = plt.subplots(figsize=(9, 3.6))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], [r["seconds"]["indexed"] for r in res["shapes"]], 0.4, label="indexed", color="#999")
    ax.bar([i + 0.2 for i in x], [r["seconds"]["unbind"] for r in res["shapes"]], 0.4, label="unbind", color="#c63")
    ax.set_xticks(list(x), names, fontsize=8)
    ax.set_ylabel("forward + backward (s)")
    ax.legend()
    fig.suptitle("gated delta rule scan, one thread")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--hw", default="cpu2")
    a = p.parse_args(argv)
    res = run(a.repeat)
    res["date"] = datetime.date.today().isoformat()
    os.makedirs(RESULTS, exist_ok=True)
    stem = os.path.join(RESULTS, f"delta-rule-scan-{a.hw}-{res['date']}")
    with open(stem + ".json", "w") as f:
        json.dump(res, f, indent=1)
    plot(res, stem + ".png")
    print(f"[delta_rule_scan] bit for bit: {res['bitwise_equal']}; wrote {stem}.json/.png")


if __name__ == "__main__":
    main()
