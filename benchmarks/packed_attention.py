"""Packed rows' attention alone, forward + backward (issue #43): the whole row under transformers'
block-diagonal mask, one SDPA call per sample (`ray_dhp.models.segment_attention`), and the
padded groups' attention (pairs of similar length, padding mask), on the same samples.

The samples: ``--samples`` lengths of the packing benchmark's mix (20-1,000 text tokens
log-uniform, plus 40 for the template and an image), packed by `pack_rows` into rows of
``--max-tokens``; the demo LM's heads and head size (``--family``). The contenders run in turn
``--repeat`` times on one thread; each reports its quickest. Nothing here asserts.

Run: ``python -m benchmarks.packed_attention [--family qwen2_5_vl] [--samples 8]``.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)


def main(argv=None) -> None:
    import torch
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from ray_dhp.data.collate import pack_rows
    from ray_dhp.demo import tiny_model_config
    from ray_dhp.models.segment_attention import segment_attention
    from ray_dhp.models.segments import SEGMENTS_KWARG

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="qwen2_5_vl")
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=5)
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    tc = tiny_model_config(a.family).get_text_config()
    heads, kv = tc.num_attention_heads, tc.num_key_value_heads
    dim = getattr(tc, "head_dim", None) or tc.hidden_size // heads

    class Attn(torch.nn.Module):
        num_key_value_groups, is_causal = heads // kv, True

    attn, rng = Attn(), random.Random(0)
    lens = [int(20 * 50 ** rng.random()) + 40 for _ in range(a.samples)]
    rows = pack_rows(lens, a.max_tokens)
    length = max(sum(lens[i] for i in r) for r in rows)
    segs = []
    for r in rows:
        segs += [lens[i] for i in r] + ([length - sum(lens[i] for i in r)] if length > sum(lens[i] for i in r) else [])
    cu = torch.cumsum(torch.tensor([0] + segs), 0)
    ids = torch.repeat_interleave(torch.arange(len(segs)), torch.tensor(segs)).view(len(rows), length)
    block = ((ids[:, :, None] == ids[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril())[:, None]

    def qkv(batch, n):
        return [torch.randn(batch, n, h, dim).transpose(1, 2).requires_grad_() for h in (heads, kv, kv)]

    def whole_row():
        o, _ = sdpa_attention_forward(attn, *qkv(len(rows), length), block)
        o.sum().backward()

    def per_segment():
        o, _ = segment_attention(attn, *qkv(len(rows), length), None, **{SEGMENTS_KWARG: cu})
        o.sum().backward()

    def padded_groups():
        s = sorted(lens)
        for g in (s[i:i + 2] for i in range(0, len(s), 2)):
            n = max(g)
            keep = torch.arange(n)[None, :] < torch.tensor(g)[:, None]
            mask = (keep[:, None, :] & torch.ones(n, n, dtype=torch.bool).tril())[:, None]
            o, _ = sdpa_attention_forward(attn, *qkv(len(g), n), mask)
            o.sum().backward()

    contenders = {"whole row, block mask": whole_row, "one call per segment": per_segment,
                  "padded groups of 2": padded_groups}
    best = {k: float("inf") for k in contenders}
    for _ in range(a.repeat):
        for k, f in contenders.items():
            t = time.perf_counter()
            f()
            best[k] = min(best[k], time.perf_counter() - t)
    print(f"[packed_attention] {a.family}: {heads} heads ({kv} kv) x {dim}, {a.samples} samples "
          f"{sum(lens)} tokens in {len(rows)} rows of {length}")
    for k, t in best.items():
        print(f"[packed_attention] {k:24s} {t * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
