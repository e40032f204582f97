"""Checkpoints that lose nothing: save at one layout, resume at another, export, import.

The invariant: 3 steps at layout A + save + load at layout B + 3 steps == 6 uninterrupted steps
of the single-process reference (`ray_dhp.step.reference`), for the losses of every step and every
rank's copy of every parameter. Both runs draw their data from a real `StepSampler`, so the data
position must be restored too; the cosine schedule with warmup and AdamW's moments make a lost
scheduler or optimizer state an O(lr) parameter error, far above the tolerance.

Everything runs in fp64 with a 1e-10 relative tolerance (the parity matrix's, see
tests/distributed/test_parity.py). Not fp32: after an AdamW step an fp32 comparison of parameters
is ill-conditioned. Adam divides each gradient entry by its own magnitude, so an entry whose
gradient is small (e.g. the low-frequency rotary dimensions of the key biases) turns fp32
summation-order noise (which depends on the CPU kernels and thread count) into a parameter change
of up to ``lr``; a 1e-5 fp32 tolerance held on one machine and failed on another (issue #20).
In fp64 the summation-order noise is ~1e-16 relative, far below Adam's ``eps`` (1e-8), so the
update is well defined; measured worst ~1e-13.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from ray_dhp import demo
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.checkpoint_cases import (CFG, COLLOCATED_SP2_TP2, DISJOINT_1V_2T, DTYPE, FAMILY, TOL,
                                                _sampler, assert_matches, run)
from tests.distributed.parity import rel_err
from tests.spawn import run_on_ranks

SINGLE = dict(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return str(demo.make_dataset(tmp_path_factory.mktemp("data"), num_samples=16, seed=0,
                                 text_only_every=4, image_sizes=((56, 56), (84, 56), (112, 84))))


@pytest.fixture(scope="module")
def reference(data):
    from ray_dhp.step.reference import ReferenceTrainer

    sampler = _sampler(data, CFG)
    ref = ReferenceTrainer(demo.tiny_model_config(FAMILY), CFG.optim, precision=CFG.precision, dtype=DTYPE)
    history = [ref.step(sampler.next_step()) for _ in range(CFG.optim.num_steps)]
    return {"history": history, "params": ref.named_parameters(), "model": ref.model}


@pytest.fixture(scope="module")
def first_half(data, tmp_path_factory):
    """Steps 1-3 at collocated SP=2/TP=2, checkpoints after steps 2 and 3."""
    root = str(tmp_path_factory.mktemp("ckpts"))
    out = run(COLLOCATED_SP2_TP2, data, stop=3, save_at=(2, 3), ckpt_root=root)
    return out, root


@pytest.fixture(scope="module")
def probe(data):
    """A text-only sample (fixed input for the logits comparisons)."""
    from ray_dhp.data.reading import read_annotations, resolve_data_root

    proc = demo.tiny_processor(FAMILY)
    samples = (proc.process(r, resolve_data_root(data)) for r in read_annotations(data))
    return next(s for s in samples if s.pixel_values is None)


@pytest.fixture(scope="module")
def resumed(data, first_half, probe):
    """Steps 4-6 at disjoint 1 vision + 2 text (TP=2) from the step-3 checkpoint; saves step 6."""
    _, root = first_half
    return run(DISJOINT_1V_2T, data, resume_from=os.path.join(root, "checkpoint_000003"),
               save_at=(6,), ckpt_root=root, probe=probe)


def test_checkpoint_files_are_unique_per_rank_and_committed(first_half):
    from ray_dhp.checkpointing import checkpoint

    _, root = first_half
    d = os.path.join(root, "checkpoint_000003")
    names = sorted(os.listdir(d))
    assert names == sorted([".metadata", "COMMIT", checkpoint.META_FILE, "__0_0.distcp",
                            "__1_0.distcp", "rng_rank0.pt", "rng_rank1.pt", checkpoint.PROCESSOR_DIR])
    assert checkpoint.is_complete(d)
    meta = checkpoint.read_meta(d)
    assert (meta["step"], meta["family"], meta["world_size"]) == (3, FAMILY, 2)
    train = meta["sampler"]["datasets"]["train"]
    assert (train["epoch"], train["pos"], train["draws"]) == (0, 12, 12)  # 3 steps x 4 samples
    # every file of every rank is listed with its size and hash, and they verify
    listed = {n for n in meta["files"] if not n.startswith(checkpoint.PROCESSOR_DIR + os.sep)}
    assert listed == set(names) - {"COMMIT", checkpoint.META_FILE, checkpoint.PROCESSOR_DIR}
    assert any(n.startswith(checkpoint.PROCESSOR_DIR + os.sep) for n in meta["files"])
    assert checkpoint.resolve(d) == d


def test_a_background_write_is_the_state_of_its_step(first_half):
    """Step 3 trained (updating every parameter in place) while step 2's checkpoint was being
    written: the checkpoint holds exactly step 2's parameters."""
    from ray_dhp.checkpointing.export import read_model_tensors

    out, root = first_half
    saved = read_model_tensors(os.path.join(root, "checkpoint_000002"))
    assert set(saved) == set(out["at_save"][2])
    for name, p in out["at_save"][2].items():
        assert torch.equal(saved[name], p), name
    assert any(not torch.equal(saved[n], p) for n, p in out["at_save"][3].items())


def test_resume_at_another_layout_matches_uninterrupted_reference(first_half, resumed, reference):
    assert resumed["first"] == 3
    first, _ = first_half
    assert_matches(first["history"] + resumed["history"], resumed, reference)


def test_export_hf_loads_and_gives_the_sharded_logits(data, first_half, resumed, probe, tmp_path):
    import transformers

    from ray_dhp import export_hf

    _, root = first_half
    out = export_hf(os.path.join(root, "checkpoint_000006"), tmp_path / "hf")
    assert {"config.json", "model.safetensors"} <= set(os.listdir(out))
    with pytest.raises(FileExistsError):  # never merged into an existing export
        export_hf(os.path.join(root, "checkpoint_000006"), out)
    assert export_hf(os.path.join(root, "checkpoint_000006"), out, overwrite=True) == str(out)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out)
    exported = dict(model.named_parameters())
    assert set(exported) == set(resumed["params"])
    for name, p in resumed["params"].items():
        assert torch.equal(exported[name], p), name
    with torch.no_grad():
        logits = model(input_ids=probe.input_ids[None], mm_token_type_ids=probe.mm_token_type_ids[None],
                       use_cache=False).logits
    assert rel_err(logits, resumed["logits"]) <= TOL
    # the processor travels with the model: same tokens, same image grids
    from ray_dhp.data.processing import load_processor

    rec = {"image": "images/000.png", "conversations": [
        {"from": "human", "value": "<image>\nWhat is shown?"}, {"from": "gpt", "value": "two red circles"}]}
    data_root = os.path.dirname(data)
    a = demo.tiny_processor(FAMILY).process(rec, data_root)
    b = load_processor(out).process(rec, data_root)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.labels, b.labels)
    assert torch.equal(a.image_grid_thw, b.image_grid_thw) and torch.equal(a.pixel_values, b.pixel_values)


def test_torn_checkpoint_is_detected_and_skipped(first_half, tmp_path):
    from ray_dhp.checkpointing import checkpoint

    _, root = first_half
    run_dir = tmp_path / "run"
    for step in (2, 3):
        shutil.copytree(os.path.join(root, f"checkpoint_{step:06d}"), run_dir / f"checkpoint_{step:06d}")
    torn = run_dir / "checkpoint_000003"
    assert checkpoint.resolve(str(run_dir)) == str(torn)
    (torn / "__1_0.distcp").unlink()  # one rank's shards never arrived
    assert not checkpoint.is_complete(str(torn))
    assert checkpoint.resolve(str(torn)) == str(run_dir / "checkpoint_000002")
    assert checkpoint.resolve(str(run_dir)) == str(run_dir / "checkpoint_000002")
    shutil.copy(os.path.join(root, "checkpoint_000003", "__1_0.distcp"), torn / "__1_0.distcp")
    with open(torn / "__0_0.distcp", "r+b") as f:  # a shard cut short
        f.truncate(100)
    assert not checkpoint.is_complete(str(torn))
    shutil.rmtree(run_dir / "checkpoint_000002")
    os.remove(torn / checkpoint.COMMIT_FILE)
    with pytest.raises(FileNotFoundError, match="incomplete"):
        checkpoint.resolve(str(torn))


def test_pretrained_directory_loads_into_a_dhp_layout(data, tmp_path):
    """``DHPConfig(model=dir)``: weights from ``save_pretrained`` (not the seed's random init)
    reach every shard; the first loss and update equal the unsharded model's."""
    from ray_dhp.models import build_model
    from ray_dhp.step.reference import ReferenceTrainer

    model_dir = str(tmp_path / "pretrained")
    build_model(demo.tiny_model_config(FAMILY), seed=1234).save_pretrained(model_dir)
    cfg = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, max_grad_norm=1.0, seed=0)
    got = run(COLLOCATED_SP2_TP2, data, model=model_dir, cfg=cfg)
    ref = ReferenceTrainer(model_dir, cfg.optim, precision=cfg.precision, dtype=DTYPE)
    saved = ref.named_parameters()  # the fp32 weights, exactly representable in fp64
    for out in got["per_rank"]:
        for name, p in out["params0"].items():
            assert torch.equal(p, saved[name]), name
    ref_out = {"history": [ref.step(_sampler(data, cfg).next_step())], "params": ref.named_parameters()}
    assert_matches(got["history"], got, ref_out)


RESHARD_SLOW = [
    ("tp2-to-tp1", DISJOINT_1V_2T, SINGLE),
    ("sp2dp2-tp2dp2-to-disjoint-2v-1t", dict(placement="collocated", vision_dp=2, vision_sp=2,
                                             text_dp=2, text_tp=2),
     dict(placement="disjoint", vision_dp=1, vision_sp=2, text_dp=1, text_tp=1)),
]


@pytest.mark.slow
@pytest.mark.parametrize("name, before, after", RESHARD_SLOW, ids=[c[0] for c in RESHARD_SLOW])
def test_reshard_more_layouts(name, before, after, data, reference, tmp_path):
    root = str(tmp_path)
    first = run(before, data, stop=3, save_at=(3,), ckpt_root=root)
    second = run(after, data, resume_from=root)  # a folder of checkpoints: its newest
    assert second["first"] == 3
    assert_matches(first["history"] + second["history"], second, reference)


def _fallback_body(rank, world, root):
    """Each rank saves (and loads) a tensor of its own; rank 1's item of the newest checkpoint
    is corrupt, so only rank 1 can see it."""
    import torch.distributed.checkpoint as dcp

    from ray_dhp.checkpointing import checkpoint, integrity
    from ray_dhp.checkpointing.hashing import HashingWriter, VerifyingReader

    for step in (2, 4):
        d = os.path.join(root, f"checkpoint_{step:06d}")
        writer = HashingWriter(d)
        dcp.save({f"w{rank}": torch.full((1000,), float(step + rank))}, storage_writer=writer)
        parts = [None] * world
        torch.distributed.all_gather_object(parts, integrity.file_records(d, writer.chunks, writer.chunks))
        if rank == 0:
            files = integrity.file_records(d, [".metadata"])
            for p in parts:
                files.update(p)
            integrity.commit(d, {"format_version": checkpoint.FORMAT_VERSION, "step": step,
                                 "files": files})
        torch.distributed.barrier()
    if rank == 1:
        path = os.path.join(root, "checkpoint_000004", "__1_0.distcp")
        raw = bytearray(open(path, "rb").read())
        raw[len(raw) // 2] ^= 0x04
        open(path, "wb").write(bytes(raw))
    torch.distributed.barrier()
    got = {f"w{rank}": torch.zeros(1000)}

    def load_one(d, meta):
        dcp.load(got, storage_reader=VerifyingReader(d, integrity.shard_chunks(meta)))

    used = checkpoint.load_first_intact(root, load_one)
    return os.path.basename(used), float(got[f"w{rank}"][0])


def test_a_flipped_bit_on_one_rank_makes_every_rank_fall_back_together(tmp_path):
    """The shard checksums are checked while loading; rank 1's mismatch fails the load on both
    ranks, and both load the previous checkpoint (not a mix of the two)."""
    outs = run_on_ranks(_fallback_body, 2, args=(str(tmp_path),))
    assert outs == [("checkpoint_000002", 2.0), ("checkpoint_000002", 3.0)]


@pytest.mark.slow
def test_packed_resume_mid_epoch_matches_uninterrupted(data, tmp_path):
    """Packing (``packing=True``, rows of at most 80 tokens: samples are 30-43, so 2 per row):
    3 steps at collocated SP2/TP2 (one text replica: 4 samples, 2 packed rows), saved mid-epoch
    (16 samples, 4 per step: step 3 of the epoch's 4), resumed at vision DP2 + text DP2 (the
    packed rows shared out over two text replicas), 3 more steps == 6 uninterrupted reference
    steps: the same samples in the same micro-batches at every step (so the same packed rows,
    `pack_bins` of them), every loss, every rank's copy of every parameter (``TOL``)."""
    from dataclasses import replace

    from ray_dhp.parallel.packed_rows import pack_bins
    from ray_dhp.step.reference import ReferenceTrainer

    cfg = replace(CFG, packing=True, max_tokens=80)
    sampler = _sampler(data, cfg)
    trainer = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision, dtype=DTYPE)
    steps = [sampler.next_step() for _ in range(cfg.optim.num_steps)]
    ref = {"history": [trainer.step(s) for s in steps], "params": trainer.named_parameters()}
    rows = [pack_bins([s.num_tokens for s in mb], cfg.data.max_tokens) for st in steps for mb in st]
    assert any(len(r) > 1 for rs in rows for r in rs)  # rows hold several samples
    root = str(tmp_path)
    first = run(COLLOCATED_SP2_TP2, data, stop=3, save_at=(3,), ckpt_root=root, cfg=cfg)
    after = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)
    second = run(after, data, resume_from=root, cfg=cfg)
    assert second["first"] == 3
    assert first["drawn"] + second["drawn"] == [[[s.index for s in mb] for mb in st] for st in steps]
    assert_matches(first["history"] + second["history"], second, ref)


@pytest.mark.slow
def test_omni_packed_resume_mid_epoch_at_expert_parallel(tmp_path):
    """The Qwen3-Omni thinker packed (rows of at most 340 tokens: images, clips, the image + clip
    record, text and 335-token videos): 3 steps collocated at vision SP2 / audio DP2 / text TP2,
    saved mid-epoch (12 of the 13 records drawn), resumed at vision DP2 / audio DP2 / text DP2
    with expert parallelism EP2 (the experts resharded, the packed rows shared out over two
    text replicas), 3 more steps (into the next epoch) == 6 uninterrupted reference steps. The
    loss 1e-8 and the audio key biases left out, as the family's matrix row
    (`family_rows.OMNI3`: the router loss's fp32 sums; an exact zero gradient)."""
    from dataclasses import replace

    from ray_dhp.parallel.packed_rows import pack_bins
    from ray_dhp.demo.omni import make_omni_dataset
    from ray_dhp.parallel.topology import EncoderDegrees
    from ray_dhp.step.reference import ReferenceTrainer
    from tests.distributed.family_checks import OMNI3_ZERO_GRAD
    from tests.distributed.omni_cases import CLIP_SECONDS

    family = "qwen3_omni_moe"
    data = str(make_omni_dataset(tmp_path / "data", videos=2, clip_seconds=CLIP_SECONDS[family]))
    cfg = replace(CFG, packing=True, max_tokens=340)
    sampler = _sampler(data, cfg, family)
    trainer = ReferenceTrainer(demo.tiny_model_config(family), cfg.optim, precision=cfg.precision, dtype=DTYPE)
    steps = [sampler.next_step() for _ in range(cfg.optim.num_steps)]
    ref = {"history": [trainer.step(s) for s in steps], "params": trainer.named_parameters()}
    rows = [pack_bins([s.num_tokens for s in mb], cfg.data.max_tokens) for st in steps for mb in st]
    assert any(len(r) > 1 for rs in rows for r in rs)  # rows hold several samples
    assert any(s.audio_lengths is not None for st in steps[:3] for mb in st for s in mb)
    audio = {"audio": EncoderDegrees(dp=2)}
    before = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2, encoders=audio)
    after = dict(placement="collocated", vision_dp=2, vision_sp=1, text_dp=2, text_tp=1, text_ep=2,
                 encoders=audio)
    root = str(tmp_path / "ckpt")
    first = run(before, data, stop=3, save_at=(3,), ckpt_root=root, cfg=cfg, family=family)
    second = run(after, data, resume_from=root, cfg=cfg, family=family)
    assert second["first"] == 3
    assert first["drawn"] + second["drawn"] == [[[s.index for s in mb] for mb in st] for st in steps]
    assert_matches(first["history"] + second["history"], second, ref, loss_tol=1e-8,
                   skip=OMNI3_ZERO_GRAD)
