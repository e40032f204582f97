"""Ulysses SP for the Qwen vision towers vs the stock single-process tower (outputs AND gradients).

Each SP rank runs ``vision_forward`` on its share, backprops ``(local_out * W[rows]).sum()`` and
all-reduce-SUMs the parameter gradients over the SP group; the reference is the stock tower's
``(full_out * W).sum()`` on one process. One spawn per SP degree runs every case (all families,
plus the rank-with-no-tokens cases) and is cached, so the tests below share it.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.distributed.tiny_towers import FAMILIES, tiny_vision_config
from tests.spawn import run_on_ranks

GRIDS = ((1, 4, 4), (1, 8, 6), (1, 6, 8))  # 3 images of different sizes (h, w multiples of merge 2)
EMPTY_GRIDS = {  # one image too small for sp=2: one rank (three at sp=4) gets no tokens
    "qwen2_vl": ((1, 2, 2),),  # a single merge unit
    "qwen2_5_vl": ((1, 4, 4),),  # a single window (2x2 merge units)
    "qwen3_vl": ((1, 2, 2),),
    "qwen3_5": ((1, 2, 2),),
}
VIDEO_GRIDS = ((2, 6, 10), (1, 2, 2), (1, 16, 12))  # a 2-frame clip (one segment per frame) + images
CASES = (tuple((f, GRIDS) for f in FAMILIES) + tuple((f, g) for f, g in EMPTY_GRIDS.items())
         + tuple((f, VIDEO_GRIDS) for f in FAMILIES))
# fp32, no optimizer (outputs and gradients only, so nothing divides by a small gradient): the
# sharded run does the same arithmetic on row subsets (BLAS blocking differs with the row count
# and the thread count) and sums parameter gradients over ranks in another order. Two orders of an
# N-term fp32 sum differ by ~sqrt(N) u (u = 2^-24 ~ 6e-8) of the terms' magnitude; the longest
# sums are the weight gradients over N <= ~400 rows x 64 features ~ 3e4 terms, sqrt(N) u ~ 1e-5 at
# most, and the errors are measured relative to the tensor's largest entry. Measured ~1e-7, so
# 1e-5 is a safe bound while any real bug (a wrong row, rotary angle, segment or a
# missing/doubled gradient) is O(1).
RTOL = 1e-5


def build_tower(family: str, seed: int = 0):
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel
    from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5VisionModel
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel

    cls = {"qwen2_vl": Qwen2VisionTransformerPretrainedModel,
           "qwen2_5_vl": Qwen2_5_VisionTransformerPretrainedModel, "qwen3_vl": Qwen3VLVisionModel,
           "qwen3_5": Qwen3_5VisionModel}[family]
    torch.manual_seed(seed)
    return cls._from_config(tiny_vision_config(family), dtype=torch.float32)


def random_images(grids, seed: int = 1):
    grid_thw = torch.tensor(grids, dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(grid_thw.prod(-1).sum()), 3 * 2 * 14 * 14, generator=g), grid_thw


def probe_weights(n_rows: int, dim: int, seed: int = 2):
    return torch.randn(n_rows, dim, generator=torch.Generator().manual_seed(seed))


def stock_reference(family: str, grids):
    """Stock tower on one process: full output (pooler [+ deepstack]) and parameter grads."""
    tower = build_tower(family)
    pixels, grid_thw = random_images(grids)
    out = tower(pixels, grid_thw=grid_thw)
    full = torch.cat([out.pooler_output, *(getattr(out, "deepstack_features", None) or [])], dim=-1)
    (full * probe_weights(*full.shape)).sum().backward()
    return full.detach(), {n: p.grad.clone() for n, p in tower.named_parameters()}


def sharded_case(rank, family, grids, sp, group, seed_shift=0):
    """One SP rank's run: local output, its rows, SP-summed grads and the comm counts."""
    from ray_dhp.models.vision_qwen import plan_vision_shards, vision_forward
    from ray_dhp.parallel.comm import CommCounter

    tower = build_tower(family)
    pixels, grid_thw = random_images(grids)
    plan = plan_vision_shards(family, tower.config, grid_thw, sp)
    comm = CommCounter()
    out = vision_forward(family, tower, pixels, plan, rank, group, comm)
    fwd = comm.total("all_to_all", "vision.sp")
    rows = plan.rows(rank)
    (out * probe_weights(len(plan.order), out.shape[-1])[rows]).sum().backward()
    grads = {}
    for n, p in tower.named_parameters():
        grads[n] = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        if group is not None:
            dist.all_reduce(grads[n], group=group)
    total = comm.total("all_to_all", "vision.sp")
    return dict(out=out.detach(), rows=rows, grads=grads, tokens=plan.tokens_per_rank(),
                fwd=(fwd.calls, fwd.bytes), total=(total.calls, total.bytes))


def _portable(obj):
    """Tensors -> numpy for the trip back to the parent (torch's shared-memory pickling of tensors
    needs the child alive, and the spawned ranks exit right after returning)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().numpy()
    if isinstance(obj, dict):
        return {k: _portable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_portable(v) for v in obj)
    return obj


def _tensors(obj):
    if isinstance(obj, np.ndarray):
        return torch.from_numpy(obj)
    if isinstance(obj, dict):
        return {k: _tensors(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tensors(v) for v in obj)
    return obj


def _cases_body(rank, world_size, cases):
    return _portable([sharded_case(rank, f, g, world_size, dist.group.WORLD) for f, g in cases])


@functools.lru_cache(maxsize=None)
def run_cases(sp: int) -> dict:
    """{(family, grids): [per-rank result]} for every case in CASES, one spawn per sp."""
    if sp == 1:
        per_rank = [[sharded_case(0, f, g, 1, None) for f, g in CASES]]
    else:
        per_rank = _tensors(run_on_ranks(_cases_body, sp, (CASES,)))
    return {case: [r[i] for r in per_rank] for i, case in enumerate(CASES)}


def assemble(results) -> torch.Tensor:
    n_rows = sum(len(r["rows"]) for r in results)
    full = torch.zeros(n_rows, results[0]["out"].shape[-1])
    seen = torch.zeros(n_rows, dtype=torch.long)
    for r in results:
        full[r["rows"]] = r["out"]
        seen[r["rows"]] += 1
    assert torch.equal(seen, torch.ones_like(seen)), "every row must be computed by exactly one rank"
    return full


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def assert_matches_stock(family, grids, results):
    ref_out, ref_grads = stock_reference(family, grids)
    assert rel_err(assemble(results), ref_out) <= RTOL
    grads = results[0]["grads"]
    assert grads.keys() == ref_grads.keys()
    errs = {n: rel_err(grads[n], ref_grads[n]) for n in ref_grads}
    worst = max(errs, key=errs.get)
    assert errs[worst] <= RTOL, (worst, errs[worst])


@pytest.mark.parametrize("sp", [1, 2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_stock_outputs_and_grads(family, sp):
    assert_matches_stock(family, GRIDS, run_cases(sp)[(family, GRIDS)])


@pytest.mark.parametrize("family", FAMILIES)
def test_video_frames_and_mixed_sizes(family):
    assert_matches_stock(family, VIDEO_GRIDS, run_cases(2)[(family, VIDEO_GRIDS)])


@pytest.mark.parametrize("sp", [2, 4])
@pytest.mark.parametrize("family", FAMILIES)
def test_rank_with_no_tokens(family, sp):
    results = run_cases(sp)[(family, EMPTY_GRIDS[family])]
    assert 0 in results[0]["tokens"], "the case must leave one rank without tokens"
    assert_matches_stock(family, EMPTY_GRIDS[family], results)


@pytest.mark.parametrize("family", FAMILIES)
def test_all_to_all_counts_and_bytes(family):
    """2 all-to-alls per full-attention block per forward (none in window blocks), 2 more in backward."""
    results = run_cases(2)[(family, GRIDS)]
    cfg = tiny_vision_config(family)
    n_full = len(cfg.fullatt_block_indexes) if family == "qwen2_5_vl" else cfg.depth
    dim, sp, elem = cfg.num_heads * 8, 2, 4  # head_dim 8, fp32
    for r in results:
        s_loc = len(r["rows"]) * 4
        s_tot = sum(r["tokens"])
        fwd_bytes = n_full * (3 * s_loc * dim + s_tot * dim // sp) * elem  # qkv out, attention back
        bwd_bytes = n_full * (s_loc * dim + 3 * s_tot * dim // sp) * elem  # the adjoints
        assert r["fwd"] == (2 * n_full, fwd_bytes)
        assert r["total"] == (4 * n_full, fwd_bytes + bwd_bytes)


def _adjoint_body(rank, world_size, seq_lens):
    from ray_dhp.parallel.ulysses import UlyssesContext, heads_to_seq, seq_to_heads

    ctx = UlyssesContext(group=dist.group.WORLD, seq_lens=list(seq_lens), rank=rank)
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(seq_lens[rank], 3, 6, 5, generator=g, dtype=torch.float64, requires_grad=True)
    y = torch.randn(sum(seq_lens), 3, 6 // world_size, 5, generator=g, dtype=torch.float64)
    ax = seq_to_heads(x, ctx)
    lhs = (ax * y).sum()
    rhs = (x * heads_to_seq(y, ctx)).sum()
    lhs.backward()  # autograd backward of seq_to_heads must be heads_to_seq
    roundtrip = heads_to_seq(ax, ctx)
    sums = torch.stack([lhs.detach(), rhs.detach()])
    dist.all_reduce(sums)
    return dict(sums=sums.tolist(), grad_ok=torch.equal(x.grad, heads_to_seq(y, ctx)),
                roundtrip_ok=torch.equal(roundtrip, x.detach()), shape=tuple(ax.shape))


def test_all_to_all_adjoint_uneven_splits():
    """<a2a(x), y> = <x, a2a_back(y)> summed over ranks, with uneven splits including a zero."""
    seq_lens = (3, 0, 5)
    results = run_on_ranks(_adjoint_body, 3, (seq_lens,))
    for r in results:
        lhs, rhs = r["sums"]
        assert abs(lhs - rhs) <= 1e-12 * max(1.0, abs(lhs))  # fp64, a permutation: exact up to summation order
        assert r["grad_ok"] and r["roundtrip_ok"]
        assert r["shape"] == (8, 3, 2, 5)


def _two_replicas_body(rank, world_size):
    """dp=2 x sp=2 in a world of 4: each replica has its own images and its own SP subgroup."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica, sp_rank = divmod(rank, 2)
    grids = GRIDS if replica == 0 else EMPTY_GRIDS["qwen2_5_vl"] + GRIDS[1:]
    return _portable(sharded_case(sp_rank, "qwen2_5_vl", grids, 2, groups[replica])), grids


@pytest.mark.slow
def test_sp_subgroups_inside_larger_world():
    results = _tensors(run_on_ranks(_two_replicas_body, 4))
    for replica in range(2):
        (r0, grids), (r1, _) = results[2 * replica], results[2 * replica + 1]
        assert_matches_stock("qwen2_5_vl", grids, [r0, r1])


def test_heads_not_divisible_by_sp():
    from ray_dhp.models.vision_qwen import plan_vision_shards

    with pytest.raises(ValueError, match="divisible"):
        plan_vision_shards("qwen2_vl", tiny_vision_config("qwen2_vl"), torch.tensor([GRIDS[0]]), 3)
