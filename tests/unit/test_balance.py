"""Balanced assignment of a step's samples (ray_dhp.parallel.balance): pure functions, no ranks."""

import itertools
import random

import pytest
import torch

from ray_dhp import demo
from ray_dhp.data.budget import cut_micro_batches
from ray_dhp.data.sample import Sample
from ray_dhp.step.engine import layout_micro_batch
from ray_dhp.data.collate import pack_rows
from ray_dhp.parallel.balance import (Balancer, balanced_micro_batches, contiguous,
                                      decode_owners, imbalance, lpt, lpt_grouped, lpt_padded,
                                      padded_groups)
from ray_dhp.parallel.packed_rows import pack_bins, pack_order
from ray_dhp.step.microbatch import balancer_for, cost_model_of
from ray_dhp.parallel.topology import Topology


def _sample(i, patches_hw=None, tokens=32):
    grid = None if patches_hw is None else torch.tensor([[1, *patches_hw]])
    ids = torch.zeros(tokens, dtype=torch.long)
    return Sample(i, ids, ids.clone(), ids.clone(), image_grid_thw=grid)


def _mix(n=8, seed=0):
    """Photos (8x8 patches), charts (16x16), documents (32x32: 16x the photo) and text-only."""
    rng = random.Random(seed)
    sizes = [(8, 8), (16, 16), (32, 32), None]
    return [_sample(i, rng.choice(sizes), tokens=rng.choice([24, 40, 300])) for i in range(n)]


def _loads(costs, parts):
    return [sum(costs[i] for i in p) for p in parts]


def test_lpt_covers_each_index_once_and_feeds_every_part():
    for n, parts in [(1, 1), (5, 2), (7, 3), (8, 4), (4, 4)]:
        costs = [0] * n  # all zero (text-only samples on the vision side): still one per part
        out = lpt(costs, parts)
        assert sorted(itertools.chain(*out)) == list(range(n))
        assert all(len(p) >= 1 for p in out) and all(p == sorted(p) for p in out)


def test_lpt_beats_contiguous_and_is_near_optimal():
    costs = [1, 1, 1, 256, 1, 1, 16, 16]  # one 16x document among photos
    bal, cnt = lpt(costs, 2), contiguous(len(costs), 2)
    assert max(_loads(costs, bal)) == 256 < max(_loads(costs, cnt))  # the document alone
    rng = random.Random(1)
    for _ in range(50):  # against brute force: LPT is within 4/3 of the optimum
        c = [rng.choice([1, 4, 16, 64, 256]) for _ in range(rng.randint(2, 9))]
        best = min(max(_loads(c, [[i for i in range(len(c)) if a[i] == p] for p in range(2)]))
                   for a in itertools.product(range(2), repeat=len(c)))
        assert max(_loads(c, lpt(c, 2))) <= 4 / 3 * best + 1e-9


def test_lpt_is_deterministic_and_ties_follow_position_and_rotation():
    assert lpt([5, 5, 5, 5], 2) == [[0, 2], [1, 3]]
    assert lpt([5, 5, 5, 5], 2, rotate=1) == [[1, 3], [0, 2]]
    assert lpt([3, 9, 3, 9], 2) == lpt([3, 9, 3, 9], 2)


def test_imbalance():
    assert imbalance([1, 1, 1, 1], [[0, 1], [2, 3]]) == 1.0
    assert imbalance([3, 1], [[0], [1]]) == 1.5


def test_balanced_micro_batches_keep_counts_and_even_both_costs():
    vision = [256, 1, 1, 1, 16, 16, 0, 0]
    text = [10, 10, 10, 10, 10, 10, 200, 200]
    out = balanced_micro_batches(vision, text, 2)
    assert sorted(itertools.chain(*out)) == list(range(8)) and [len(b) for b in out] == [4, 4]
    # the two long text-only samples and the document are spread, not stacked
    assert {6, 7} & set(out[0]) and {6, 7} & set(out[1])
    assert imbalance(text, out) < imbalance(text, contiguous(8, 2))
    with pytest.raises(ValueError, match="equal micro-batches"):
        balanced_micro_batches([1, 2, 3], [1, 2, 3], 2)


def test_decode_owners_balance_bytes_and_rotate_ties():
    owners = decode_owners([10_000, 100, 100, 100, 100], world=2)
    assert owners[0] != owners[1] and owners.count(owners[0]) == 1  # the big image alone
    assert decode_owners([1, 1, 1, 1], 4, start=2) == [2, 3, 0, 1]  # = round-robin from 2


def test_cost_model_grows_quadratically_with_full_attention():
    config = demo.tiny_model_config("qwen2_5_vl")
    m = cost_model_of(config)
    small, big = m.vision(torch.tensor([[1, 8, 8]])), m.vision(torch.tensor([[1, 32, 32]]))
    assert big > 16 * small  # 16x the patches: more than 16x the cost (attention ~ patches^2)
    assert m.vision(None) == 0
    # attention never crosses images: two images cost their sum, less than one image of both
    two = m.vision(torch.tensor([[1, 16, 16], [1, 16, 16]]))
    assert two == 2 * m.vision(torch.tensor([[1, 16, 16]])) < m.vision(torch.tensor([[1, 16, 32]]))
    assert m.text(400) > 10 * m.text(40) and isinstance(m.text(3), int)
    q2 = cost_model_of(demo.tiny_model_config("qwen2_vl"))
    assert q2.window == 0 and q2.vision_window == 0  # every block attends fully


def test_cost_model_counts_a_video_as_its_frames():
    """A video's attention is per frame (the towers' ``cu_seqlens`` have one segment per
    temporal patch), so its cost is the sum over those segments, not one ``t·h·w`` span."""
    from transformers.vision_utils import get_vision_cu_seqlens

    m = cost_model_of(demo.tiny_model_config("qwen2_5_vl"))
    video = torch.tensor([[12, 16, 16]])
    frame = m.vision(torch.tensor([[1, 16, 16]]))
    assert m.vision(video) == 12 * frame
    assert m.vision(video) < m.vision(torch.tensor([[1, 16 * 12, 16]]))  # one span: far more
    grids = torch.tensor([[12, 16, 16], [1, 8, 24], [3, 4, 6]])
    cu = get_vision_cu_seqlens(grids).long()
    seg = (cu[1:] - cu[:-1]).tolist()
    assert len(seg) == 12 + 1 + 3  # the tower's segments: one per frame
    want = sum(m.vision_linear * n + m.vision_full * n * n + m.vision_window * n * min(m.window, n)
               for n in seg)
    assert m.vision(grids) == want
    # the balancer sees the per-frame cost: a 12-frame video weighs 12 frames, so 12 images of a
    # frame's size balance against it (one span would have put every image on the other part)
    samples = [_sample(0)] + [_sample(i, (16, 16)) for i in range(1, 13)]
    samples[0].image_grid_thw = video
    bal = balancer_for("cost", demo.tiny_model_config("qwen2_5_vl"))
    parts = bal.vision_replicas(samples, 2)
    assert parts == [[0], list(range(1, 13))]
    assert imbalance(bal.vision_costs(samples), parts) == 1.0


def test_layout_balanced_vs_count():
    config = demo.tiny_model_config("qwen2_5_vl")
    topo = Topology.build(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
    samples = [_sample(0, (8, 8)), _sample(1, (32, 32)), _sample(2, (8, 8)), _sample(3, (16, 16)),
               _sample(4), _sample(5, (8, 8))]
    bal = balancer_for("cost", config)
    lay = layout_micro_batch(samples, topo, "qwen2_5_vl", config.vision_config, bal)
    cnt = layout_micro_batch(samples, topo, "qwen2_5_vl", config.vision_config)
    assert cnt.vision_samples == [[0, 1, 2], [3, 4, 5]]
    assert [1] in lay.vision_samples  # the 16x image alone
    vc = bal.vision_costs(samples)
    assert imbalance(vc, lay.vision_samples) < imbalance(vc, cnt.vision_samples)
    assert sorted(itertools.chain(*lay.text_samples)) == list(range(6))
    # rows of a non-contiguous sample list, in sample order
    rows = lay.rows_of([0, 2])
    assert rows.tolist() == list(range(0, 16)) + list(range(16 + 256, 16 + 256 + 16))


def test_lpt_padded_balances_samples_times_longest():
    lengths = [290, 256, 256, 256, 98, 98, 50, 50]
    cost = lambda n: n  # noqa: E731  (linear: a part costs samples x longest)
    out = lpt_padded(lengths, 2, cost)
    assert sorted(itertools.chain(*out)) == list(range(8))
    def worst(parts):
        return max(len(p) * max(lengths[i] for i in p) if p else 0 for p in parts)
    best = min(worst([[i for i in range(8) if a[i] == p] for p in range(2)])
               for a in itertools.product(range(2), repeat=8))
    assert worst(out) == best == 1160  # the 290-token sample with 3 short ones, not 5


def _partitions(items):
    """Every partition of ``items`` into non-empty groups."""
    if not items:
        yield []
        return
    first, rest = items[0], items[1:]
    for part in _partitions(rest):
        yield [[first]] + part
        for k in range(len(part)):
            yield part[:k] + [[first] + part[k]] + part[k + 1:]


def _grouped(lengths, groups, cost, call):
    return sum(len(g) * cost(max(lengths[i] for i in g)) + call for g in groups)


def test_padded_groups_is_the_cheapest_cut_by_brute_force():
    cost = lambda n: 6 * n + n * n // 50  # noqa: E731  (linear + attention)
    rng = random.Random(2)
    for _ in range(40):
        lengths = [rng.choice([20, 50, 64, 98, 256, 290]) for _ in range(rng.randint(1, 7))]
        call = rng.choice([0, 100, 1000, 10_000])
        out = padded_groups(lengths, cost, call)
        assert sorted(itertools.chain(*out)) == list(range(len(lengths)))
        assert all(g == sorted(g) for g in out)
        best = min(_grouped(lengths, p, cost, call) for p in _partitions(list(range(len(lengths)))))
        assert _grouped(lengths, out, cost, call) == best
    # a large call cost keeps one group (today's single padded batch); none splits off the long one
    assert padded_groups([290, 50, 50, 50], cost, 10**9) == [[0, 1, 2, 3]]
    assert padded_groups([50, 290, 50, 50], cost, 0) == [[1], [0, 2, 3]]


def test_lpt_grouped_feeds_every_part_and_beats_padded_lpt():
    cost = lambda n: n  # noqa: E731
    for n, parts in [(1, 1), (5, 2), (7, 3), (4, 4)]:
        out = lpt_grouped([10] * n, parts, cost, 5)
        assert sorted(itertools.chain(*out)) == list(range(n)) and all(out)
    lengths = [290, 256, 256, 256, 98, 98, 98, 50, 50, 50, 50, 50]
    call = 64

    def grouped_cost(part):  # the part's best cut (padded_groups is exact, tested above)
        sub = [lengths[i] for i in part]
        return _grouped(sub, padded_groups(sub, cost, call), cost, call)
    out = lpt_grouped(lengths, 2, cost, call)
    assert out == lpt_grouped(lengths, 2, cost, call)  # deterministic
    best = min(max(grouped_cost([i for i in range(12) if a[i] == p]) for p in range(2))
               for a in itertools.product(range(2), repeat=12) if 0 < sum(a) < 12)
    assert max(grouped_cost(p) for p in out) <= 4 / 3 * best
    # against one padded batch per replica (lpt_padded, the engine before groups): less work
    single = max(len(p) * max(lengths[i] for i in p) for p in lpt_padded(lengths, 2, cost))
    assert max(grouped_cost(p) for p in out) < single


def test_layout_text_groups_and_their_feature_rows():
    config = demo.tiny_model_config("qwen2_5_vl")
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    # a long image sample and short text-only ones: worth two padded groups
    samples = [_sample(0, (8, 8), tokens=30), _sample(1, tokens=20), _sample(2, (32, 32), tokens=400),
               _sample(3, tokens=24), _sample(4, (8, 8), tokens=28)]
    bal = balancer_for("cost", config)
    lay = layout_micro_batch(samples, topo, "qwen2_5_vl", config.vision_config, bal)
    (groups,) = lay.text_groups
    assert groups[0] == [2] and sorted(groups[1]) == [0, 1, 3, 4]
    # rows of each group within the replica's features (sample order 0..4: 16, 0, 256, 0, 16 rows)
    rows = lay.group_rows(lay.text_samples[0], groups)
    assert rows[0].tolist() == list(range(16, 16 + 256))
    assert rows[1].tolist() == list(range(16)) + list(range(272, 288))
    cnt = layout_micro_batch(samples, topo, "qwen2_5_vl", config.vision_config)
    assert cnt.text_groups == [[[0, 1, 2, 3, 4]]]  # by count: one padded batch, as before


def test_budget_with_balanced_replicas_keeps_every_replica_within_budget():
    lengths = [90, 10, 10, 90, 10, 10, 10, 10]
    costs = [n * n for n in lengths]

    def assign(rng):
        return lpt(costs[rng.start:rng.stop], 2)
    cuts = cut_micro_batches(lengths, budget=100, replicas=2, min_size=2, assign=assign)
    assert [i for r in cuts for i in r] == list(range(8))
    for r in cuts:
        sub = lengths[r.start:r.stop]
        assert max(_loads(sub, assign(r))) <= 100
    # by count the same budget needs more micro-batches (contiguous halves are lopsided)
    assert len(cuts) <= len(cut_micro_batches(lengths, budget=100, replicas=2, min_size=2))


def test_balancer_validation():
    with pytest.raises(ValueError, match="balance="):
        Balancer("fastest")
    with pytest.raises(ValueError, match="CostModel"):
        Balancer("cost")
    from ray_dhp.config.train_loop import TrainLoopConfig
    with pytest.raises(ValueError, match="balance: must be one of"):
        TrainLoopConfig(balance="tokens")


def test_sampler_cuts_equal_count_micro_batches_of_even_cost():
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.config.train_loop import TrainLoopConfig

    config = demo.tiny_model_config("qwen2_5_vl")
    s = StepSampler.__new__(StepSampler)
    s.cfg = TrainLoopConfig(global_batch_size=8, micro_batches=2).sampler_config()
    samples = [_sample(0, (32, 32)), _sample(1, (32, 32)), _sample(2, (8, 8)), _sample(3, (8, 8)),
               _sample(4), _sample(5), _sample(6, (8, 8)), _sample(7, (8, 8))]
    assert [[x.index for x in mb] for mb in s.cut(samples)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    s.balancer = balancer_for("cost", config)
    mbs = s.cut(samples)
    assert sorted(len(mb) for mb in mbs) == [4, 4]
    assert sorted(x.index for mb in mbs for x in mb) == list(range(8))
    assert all(sum(x.image_grid_thw is not None and int(x.image_grid_thw.prod()) == 1024
                   for x in mb) == 1 for mb in mbs)  # one document per micro-batch


def test_loader_decode_owners_balance_image_pixels(tmp_path):
    from ray_dhp.data.loader import StepLoader, decode_costs
    from ray_dhp.data.reading import read_annotations, resolve_data_root
    from ray_dhp.data.sampler import StepSampler
    from ray_dhp.config.train_loop import TrainLoopConfig

    path = demo.make_dataset(tmp_path / "d", num_samples=8, text_only_every=4,
                             image_sizes=((448, 448), (56, 56), (56, 56)))
    sampler = StepSampler(read_annotations(path), demo.tiny_processor(), resolve_data_root(path),
                          TrainLoopConfig(global_batch_size=8).sampler_config())
    costs = decode_costs(sampler, list(range(8)))
    assert costs[3] == costs[7] == 1024  # text-only
    assert costs[0] == 1024 + 448 * 448 and costs[1] == 1024 + 56 * 56
    loader = StepLoader(sampler, balancer=balancer_for("cost", demo.tiny_model_config()))
    loader.world = 2  # the owner deal only (no exchange)
    owners = loader._owners(list(range(8)))  # noqa: SLF001
    loads = [sum(c for c, o in zip(costs, owners) if o == r) for r in range(2)]
    rr = [sum(c for q, c in enumerate(costs) if q % 2 == r) for r in range(2)]
    assert max(loads) <= max(rr) and max(loads) / (sum(loads) / 2) < 1.5


# -- packed rows: first fit decreasing, the tail padding (issue #43) ------------------------------

def _padded_tokens(lengths, rows):
    return len(rows) * max(sum(lengths[i] for i in r) for r in rows)


def test_pack_bins_reorder_where_the_order_pads():
    # in order: 5 | 4 + 3 | 4, three rows of 7 (21 tokens); reordered: 5 + 3 | 4 + 4, two of 8
    assert _padded_tokens([5, 4, 3, 4], pack_rows([5, 4, 3, 4], 8)) == 21
    assert pack_bins([5, 4, 3, 4], 8) == [[0, 2], [1, 3]]
    assert pack_order([5, 4, 3, 4], 8) == [0, 2, 1, 3]
    # in order 5 + 3 | 4 + 2 | 6 (3 rows of 8); first fit decreasing at cap 7: 5 + 2 | 3 + 4 | 6
    assert pack_bins([5, 3, 4, 2, 6], 8) == [[0, 3], [1, 2], [4]]
    assert pack_bins([6, 1, 1, 1, 3], 8) == [[0], [1, 2, 3, 4]]  # in order is already even: kept
    assert pack_bins([5, 3, 4], None) == [[0, 1, 2]] and pack_bins([], 8) == []
    with pytest.raises(ValueError, match="max_tokens=8"):
        pack_bins([3, 9], 8)


def test_packed_rows_of_an_sft_mix_carry_little_tail_padding():
    """Pins the row-tail fix: replicas of 8 samples of a log-uniform 60-1,500-token mix (the
    shape of `benchmarks/packing.py`'s SFT mix) in rows of 2,048. Cut in order they ran 12%
    padding (rows only as even as the order allows); laid out by `pack_order` under 3%, never
    more padded tokens than in order, each row within the budget, and the order-preserving cut
    of that order is exactly `pack_bins`' rows (what the engine runs)."""
    rng = random.Random(0)
    real = in_order = packed = 0
    for _ in range(100):
        lengths = [int(2.0 ** rng.uniform(5.9, 10.55)) for _ in range(8)]
        order = pack_order(lengths, 2048)
        assert sorted(order) == list(range(8))
        laid = [lengths[i] for i in order]
        rows = pack_rows(laid, 2048)
        assert [[order[q] for q in r] for r in rows] == pack_bins(lengths, 2048)
        assert all(sum(laid[q] for q in r) <= 2048 for r in rows)
        before = _padded_tokens(lengths, pack_rows(lengths, 2048))
        after = _padded_tokens(laid, rows)
        assert after <= before
        real, in_order, packed = real + sum(lengths), in_order + before, packed + after
    assert 1 - real / in_order > 0.10
    assert 1 - real / packed < 0.03


def test_packing_balancer_hands_each_replica_its_samples_in_pack_order():
    config = demo.tiny_model_config("qwen2_5_vl")
    lengths = [500, 400, 300, 400, 700, 90, 120, 600]
    samples = [_sample(i, tokens=t) for i, t in enumerate(lengths)]
    packed = balancer_for("cost", config, packing=True, max_tokens=1024)
    plain = balancer_for("cost", config, packing=True)  # no budget: one row, ascending
    parts = plain.text_replicas(samples, 2)
    assert all(p == sorted(p) for p in parts)
    got = packed.text_replicas(samples, 2)
    assert [sorted(p) for p in got] == parts  # the same samples per replica: the same balance
    for p, q in zip(got, parts):
        assert p == [q[k] for k in pack_order([lengths[i] for i in q], 1024)]
    counted = balancer_for("count", config, packing=True, max_tokens=1024).text_replicas(samples, 2)
    assert [sorted(p) for p in counted] == contiguous(8, 2)
    topo = Topology.build(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)
    lay = layout_micro_batch(samples, topo, "qwen2_5_vl", config.vision_config, packed)
    assert lay.text_samples == got and lay.text_groups == [[p] for p in got]
