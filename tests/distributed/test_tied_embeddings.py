"""Tied input/output embeddings (``tie_word_embeddings=True``: Qwen2.5-VL-3B, the small Qwen3-VL
models) under text tensor parallelism.

The vocab-parallel embedding (``Shard(0)``: rows of the vocabulary) and the column-parallel
``lm_head`` (``Shard(0)``: the same rows as output features, logits left vocab-sharded for
``loss_parallel``) hold ONE sharded weight, the same DTensor Parameter on both modules
(`ray_dhp.parallel.tensor.apply_tp_plan` re-ties what ``parallelize_module`` split), so its
gradient is the sum of both uses, as in the stock model. Checked against the single-process
stock transformers model with the same tie (`ray_dhp.step.reference`):

* parity, fp64, 1e-10 relative (the parity matrix's tolerance, tests/distributed/test_parity.py:
  in fp64 only summation orders differ, ~1e-14): the loss and grad-norm of every step, every
  clipped gradient of every step (the tied weight's included), every update, every rank's copy.
  A rank whose ``lm_head`` kept its own copy would list ``lm_head.weight`` among its parameters
  (``named_parameters`` lists a shared Parameter once) and fail the harness's name check; a
  gradient from one use only fails the gradient check by O(1);
* bf16_mixed: one fp32 master for the tied weight, the bytes each rank holds equal the plan's
  (`ray_dhp.planning.memory`, the tied weight counted once);
* a save_pretrained directory (which holds ``embed_tokens`` only) read slice by slice at TP2,
  resumed at another layout (the tied weight saved once, loaded into both modules), exported
  and loaded back with ``from_pretrained`` (tied again, the same logits).
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ray_dhp import demo
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import (assert_parity, copy_errors, make_steps, rel_err, run_engine,
                                      run_reference)
from tests.spawn import run_on_ranks

EMBED = "model.language_model.embed_tokens.weight"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)
TOL = 1e-10


def _tied(family: str = "qwen2_5_vl"):
    return demo.tiny_model_config(family, tie_word_embeddings=True)


def _layout(placement, vision, text, **extra):
    (sp, vdp), (tp, tdp) = vision, text
    return dict(placement=placement, vision_dp=vdp, vision_sp=sp, text_dp=tdp, text_tp=tp, **extra)


SP2_TP2 = _layout("collocated", (2, 1), (2, 1))
LORA = {"llm": {"lora": {"r": 4, "alpha": 8}}}
# name: (family, layout, modules)
CASES = {
    "collocated-sp2-tp2": ("qwen2_5_vl", SP2_TP2, None),
    "collocated-sp4-tp4": ("qwen2_5_vl", _layout("collocated", (4, 1), (4, 1)), None),
    "collocated-sp2dp2-tp4": ("qwen2_5_vl", _layout("collocated", (2, 2), (4, 1)), None),
    "disjoint-1v-2t": ("qwen2_5_vl", _layout("disjoint", (1, 1), (2, 1)), None),
    "text-sp-collocated-sp2-tp2": ("qwen2_5_vl", {**SP2_TP2, "text_sequence_parallel": True}, None),
    "qwen3_vl-collocated-sp2-tp2": ("qwen3_vl", SP2_TP2, None),
    "lora-collocated-sp2-tp2": ("qwen2_5_vl", SP2_TP2, LORA),
    "frozen-llm-disjoint-1v-2t": ("qwen2_5_vl", _layout("disjoint", (1, 1), (2, 1)),
                                  {"llm": {"train": False}}),
}
DEFAULT = {"collocated-sp2-tp2"}


@pytest.fixture(scope="module")
def steps_cache(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = make_steps(tmp_path_factory.mktemp(family), family, CFG)
        return cache[family]

    return get


@pytest.mark.parametrize("case", [pytest.param(c, marks=() if c in DEFAULT else (pytest.mark.slow,))
                                  for c in CASES])
def test_tied_embeddings_parity_fp64(case, steps_cache):
    family, layout, modules = CASES[case]
    cfg = CFG if modules is None else replace(CFG, modules=modules)
    steps = steps_cache(family)
    ref = run_reference(family, cfg, steps, torch.float64, model=_tied(family))
    assert "lm_head.weight" not in ref["params"]  # the stock model is tied: one weight, one name
    got = run_engine(family, layout, cfg, steps, torch.float64, grads=True, model=_tied(family))
    worst = assert_parity(got, ref, loss_tol=TOL, param_tol=TOL, update_tol=TOL, grad_tol=TOL)
    # LoRA and a frozen LLM freeze the tied weight: no gradient, bit-identical on every copy
    assert (EMBED in ref["grads"][0]) == (modules is None)
    if modules is not None:
        for out in got["per_rank"]:
            if EMBED in out["params"]:
                assert torch.equal(out["params"][EMBED], out["params0"][EMBED])
    grads = [e for k, g in enumerate(ref["grads"]) for e in
             copy_errors([{"grads": o["grads"][k]} for o in got["per_rank"]], g, key="grads")]
    tied = max((e[0] for e in grads if e[2] == EMBED), default=None)
    print(f"{case}: worst update error {worst[0]:.2e} ({worst[2]}), parameter {worst[1]:.2e}, "
          f"gradient {max(grads)[0]:.2e}, tied weight's gradient "
          f"{'frozen' if tied is None else f'{tied:.2e}'}")


# -- bf16_mixed: one master, the plan's bytes ------------------------------------------------------

def _bf16_body(rank, world, layout, cfg, steps):
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    groups = build_groups(Topology.build(**layout), torch.device("cpu"))
    engine = DHPEngine(_tied(), groups, cfg.step_config())
    out = {"is_text": groups.is_text}
    if engine.text_model is not None:
        lm = engine.family.language_model(engine.text_model)
        out["tied"] = engine.text_model.lm_head.weight is lm.embed_tokens.weight
        out["master_names"] = [n for n, _ in engine.text_masters.named_parameters()]
    engine.step(steps[0])
    if engine.text_model is not None:
        lm = engine.family.language_model(engine.text_model)
        out["tied_after"] = engine.text_model.lm_head.weight is lm.embed_tokens.weight
        master = dict(engine.text_masters.named_parameters())[EMBED]
        out["rounded"] = torch.equal(lm.embed_tokens.weight.to_local(),
                                     master.to_local().to(torch.bfloat16))
    out["state"] = engine.state_bytes()
    return out


def test_bf16_mixed_one_master_and_the_plans_bytes(steps_cache):
    """bf16_mixed at collocated SP2/TP2 (2 vision ranks: ZeRO-1 splits the ViT's masters): the
    tied weight has one fp32 master (none for ``lm_head``), stays tied through the step, its
    bf16 weight is its master rounded, and each rank's weights / grads / masters / AdamW bytes
    equal `rank_state` of `count_params` (the tied weight counted once), exactly."""
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import policy_of

    cfg = replace(CFG, precision="bf16_mixed", num_steps=1)
    topo = Topology.build(**SP2_TP2)
    outs = run_on_ranks(_bf16_body, topo.world_size, args=(SP2_TP2, cfg, steps_cache("qwen2_5_vl")))
    counts, untied = count_params(_tied()), count_params(demo.tiny_model_config())
    tc = _tied().text_config
    assert counts.text == untied.text - tc.vocab_size * tc.hidden_size  # counted once
    for rank, o in enumerate(outs):
        assert o["tied"] and o["tied_after"] and o["rounded"], rank
        assert EMBED in o["master_names"] and not any("lm_head" in n for n in o["master_names"])
        want = rank_state(counts, topo, rank, policy_of(cfg.precision))
        st = o["state"]
        assert (st["weights"], st["grads"], st["masters"], st["optimizer"]) == \
            (want.weights, want.grads, want.masters, want.optimizer), (rank, st, want)


# -- a directory, resume at another layout, export ---------------------------------------------

def test_tied_directory_resume_at_another_layout_and_export(tmp_path):
    """A tied tiny model saved with ``save_pretrained`` (its safetensors hold ``embed_tokens``
    and no ``lm_head``) trains 3 steps at collocated SP2/TP2 (each rank reads its rows of the
    one tensor), saves, resumes at disjoint 1 vision + 1 text rank (TP1: the sharded tied
    weight is gathered into one tensor, shared by both modules) for 3 steps == 6 steps of the
    single-process ``from_pretrained`` model (fp64, 1e-10). The final checkpoint exports a
    directory that ``from_pretrained`` loads tied, with the trained weights and logits."""
    import transformers
    from safetensors import safe_open

    from ray_dhp import export_hf
    from ray_dhp.models import build_model
    from ray_dhp.step.reference import ReferenceTrainer
    from tests.distributed.checkpoint_cases import CFG as CKPT_CFG
    from tests.distributed.checkpoint_cases import DTYPE, _sampler, assert_matches, run

    model_dir = str(tmp_path / "tied")
    build_model(_tied(), seed=7).save_pretrained(model_dir)
    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:  # legacy names
        assert "model.embed_tokens.weight" in f.keys() and not any("lm_head" in k for k in f.keys())
    data = str(demo.make_dataset(tmp_path / "data", num_samples=16, seed=0, text_only_every=4,
                                 image_sizes=((56, 56), (84, 56), (112, 84))))
    trainer = ReferenceTrainer(model_dir, CKPT_CFG.optim, precision=CKPT_CFG.precision, dtype=DTYPE)
    assert trainer.model.lm_head.weight is trainer.model.model.language_model.embed_tokens.weight
    sampler = _sampler(data, CKPT_CFG)
    ref = {"history": [trainer.step(sampler.next_step()) for _ in range(CKPT_CFG.optim.num_steps)],
           "params": trainer.named_parameters()}
    root = str(tmp_path / "ckpts")
    first = run(SP2_TP2, data, stop=3, save_at=(3,), ckpt_root=root, model=model_dir)
    disjoint_1_1 = _layout("disjoint", (1, 1), (1, 1))
    second = run(disjoint_1_1, data, resume_from=root, save_at=(6,), ckpt_root=root, model=model_dir)
    assert second["first"] == 3
    worst = assert_matches(first["history"] + second["history"], second, ref)
    print(f"resume SP2/TP2 -> disjoint 1+1: worst parameter error {worst[0]:.2e} ({worst[2]})")

    out = export_hf(os.path.join(root, "checkpoint_000006"), str(tmp_path / "hf"))
    with safe_open(os.path.join(out, "model.safetensors"), "pt") as f:  # written once, as
        assert not any("lm_head" in k for k in f.keys())                # transformers writes it
    exported = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(out, dtype=DTYPE)
    assert exported.lm_head.weight is exported.model.language_model.embed_tokens.weight
    params = dict(exported.named_parameters())
    assert set(params) == set(second["params"])
    for name, p in second["params"].items():  # the trained weights, bit for bit
        assert torch.equal(params[name], p), name
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 64, 11]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=torch.zeros_like(ids), use_cache=False)
    with torch.no_grad():
        assert rel_err(exported(**kwargs).logits, trainer.model(**kwargs).logits) <= TOL


# -- the re-tie itself -----------------------------------------------------------------------------

def _retie_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    from ray_dhp.parallel.tensor import apply_tp_plan

    def tied_pair():
        m = torch.nn.Module()
        m.embed, m.head = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False)
        m.head.weight = m.embed.weight
        return m

    mesh = init_device_mesh("cpu", (world,))
    vocab = {"embed": RowwiseParallel(input_layouts=Replicate()),
             "head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    good = tied_pair()
    apply_tp_plan(good, mesh, vocab)
    errors = []
    for plan in ({"embed": RowwiseParallel(input_layouts=Replicate())},  # head left whole
                 {**vocab, "head": RowwiseParallel()}):                 # head sharded by columns
        try:
            apply_tp_plan(tied_pair(), mesh, plan)
        except ValueError as e:
            errors.append(str(e))
    return good.head.weight is good.embed.weight, tuple(good.embed.weight.placements), errors


def test_a_tied_weight_keeps_one_layout_or_is_refused():
    """`apply_tp_plan` puts the embedding's DTensor back on the head (same object, Shard(0));
    a plan that would lay the tied places out differently raises, naming both."""
    from torch.distributed.tensor import Shard

    tied, placements, errors = run_on_ranks(_retie_body, 2)[0]
    assert tied and placements == (Shard(0),)
    assert len(errors) == 2 and all("embed.weight and head.weight" in e for e in errors), errors
