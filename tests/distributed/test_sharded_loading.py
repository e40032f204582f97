"""Every rank holds only its shard, from the first byte; loading a sharded directory is exact.

* Parity: the engine loading a really sharded safetensors directory (``save_pretrained`` with a
  small ``max_shard_size``; legacy ``visual.*`` / ``model.*`` names) makes the same first step
  as the single-process reference's ``from_pretrained`` model, in fp64 at collocated SP2/TP2
  and disjoint 1 vision + 2 text ranks. Tolerance 1e-10 relative, as the fp64 layout matrix
  (tests/distributed/test_parity.py): only summation orders differ.
* Holdings, per rank: a disjoint vision rank holds the vision tower and no LLM parameter, a
  disjoint text rank no vision parameter, TP ranks only their shards (local shapes split by
  the plan), and every local tensor equals, bit for bit, the matching slice of the old full
  build (``build_model``: the reference's model) — from a config (random init replayed from the
  seed) and from a directory. The bytes each rank holds equal ``count_params``' per-rank count
  (what ``ray-dhp plan`` uses).
"""

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference
from tests.distributed.shard_reads import _holdings_body
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, micro_batches=2, num_steps=1,
                      max_grad_norm=0.5, weight_decay=0.1)
COLLOCATED = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
DISJOINT = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2)


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "tiny"
    build_model(demo.tiny_model_config(FAMILY), seed=11).save_pretrained(path, max_shard_size="100KB")
    assert len(list(path.glob("model-*.safetensors"))) > 3
    return str(path)


@pytest.mark.parametrize("layout", [COLLOCATED, DISJOINT], ids=["collocated-sp2-tp2", "disjoint-1v-2t"])
def test_sharded_directory_first_step_parity_fp64(layout, sharded_dir, tmp_path):
    steps = make_steps(tmp_path, FAMILY, CFG)
    ref = run_reference(FAMILY, CFG, steps, torch.float64, model=sharded_dir)
    got = run_engine(FAMILY, layout, CFG, steps, torch.float64, model=sharded_dir)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10)


def _slice_of(full: torch.Tensor, shape_local: tuple, shard_dims: list, tp_rank: int) -> torch.Tensor:
    """The TP rank's even slice of ``full`` (``shard_dims``: the sharded dim per mesh dim, or None)."""
    dims = [d for d in shard_dims if d is not None]
    if not dims:
        return full
    n = shape_local[dims[0]]
    return full.narrow(dims[0], tp_rank * n, n)


@pytest.mark.parametrize("layout,source", [(DISJOINT, "config"), (COLLOCATED, "directory")],
                         ids=["disjoint-1v-2t-config", "collocated-sp2-tp2-directory"])
def test_each_rank_holds_only_its_shards_bit_identical(layout, source, sharded_dir):
    from ray_dhp.models.sizes import count_params

    model = demo.tiny_model_config(FAMILY) if source == "config" else sharded_dir
    ref = build_model(model, seed=5)  # the old full build every rank used to make
    full = dict(ref.named_parameters())
    counts = count_params(demo.tiny_model_config(FAMILY))
    outs = run_on_ranks(_holdings_body, 3 if layout is DISJOINT else 2, args=(layout, model))
    param_of = {}  # checkpoint tensor name -> model parameter name
    if source == "directory":
        from ray_dhp.models.loading import build_meta_model

        param_of = {k: n for n, k in build_meta_model(model).directory.source.items()}
    for rank, o in enumerate(outs):
        names = set(o["held"])
        vision = {n for n in names if n.startswith("model.visual.")}
        if layout is DISJOINT:
            assert (vision == names) if rank == 0 else not vision, rank
        assert not any(meta for *_, meta in o["held"].values())
        for n, (t, shape, placements, _) in o["held"].items():
            assert shape == tuple(full[n].shape), n
            tp_rank = o["tp"][1] if o["tp"] is not None else 0
            want = _slice_of(full[n].detach(), tuple(t.shape), placements, tp_rank)
            if any(d is not None for d in placements):
                assert t.numel() * 2 == full[n].numel(), n  # TP=2: half of it, no more
            assert t.dtype == want.dtype and torch.equal(t, want), (rank, n)
        sharded = [n for n, (_, _, dims, _) in o["held"].items() if any(d is not None for d in dims)]
        assert bool(sharded) == o["is_text"], rank  # the TP plan really sharded this rank's text
        expected = (counts.vision * 4 if o["is_vision"] else 0) + \
            (counts.text_per_rank(2) * 4 if o["is_text"] else 0)
        assert o["bytes"] == expected, (rank, o["bytes"], expected)
        if source == "directory":  # read only the shard: never a whole sharded tensor
            whole = sorted({param_of.get(k, k) for k, how, _ in o["reads"] if how == "get_tensor"}
                           & set(sharded))
            assert not whole, f"rank {rank} read whole sharded tensors (get_tensor): {whole[:5]}"
            read = sum(n for *_, n in o["reads"])
            assert read == o["bytes"], (rank, read, o["bytes"])  # fp32 file, fp32 parameters
        else:
            assert not o["reads"], rank
