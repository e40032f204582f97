"""Per-module training choices (`ray_dhp.config.tuning`) are exact: a frozen vision tower, a frozen
language model and per-module learning rates / weight decay give the single-process reference's
loss, clipped gradients and updates (fp64, 1e-10 relative, as `test_parity.py`: in fp64 the only
differences are summation orders, ~1e-14), on every rank's copy, at collocated SP2/TP2 and at
disjoint 1 vision + 2 text ranks. Frozen parameters stay bit-identical, get no gradient, and the
state each rank measures equals `ray_dhp.planning.memory.rank_state` (the plan) with the frozen parts
holding weights only.
"""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
import torch

from ray_dhp import demo
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from ray_dhp.config.tuning import tuning_of
from ray_dhp.models.tuning import trains
from tests.distributed.parity import assert_parity, make_steps, run_engine, run_reference

FAMILY = "qwen2_5_vl"
BASE = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=3,
                       max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)
SP2_TP2 = dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
DISJOINT_1_2 = dict(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=2)
LAYOUTS = {"sp2-tp2": SP2_TP2, "disjoint-1v-2t": DISJOINT_1_2,
           # the LM's context parallelism (`ray_dhp.parallel.context`): adapters replicated over CP
           "sp2-cp2": dict(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=1,
                           text_cp=2)}

CHOICES = {
    "frozen-vision": {"vision": {"train": False}},               # the tower; the merger trains
    "frozen-vision-merger": {"vision": {"train": False}, "merger": {"train": False}},
    "frozen-llm": {"llm": {"train": False}},
    "per-module-lr": {"vision": {"lr": 3e-3, "weight_decay": 0.0}, "merger": {"lr": 5e-4},
                      "llm": {"lr": 2e-3, "weight_decay": 0.05}},
}
DEFAULT = {("frozen-vision", "sp2-tp2"), ("frozen-llm", "disjoint-1v-2t"),
           ("per-module-lr", "sp2-tp2")}


def _params():
    for choice in CHOICES:
        for layout in LAYOUTS:
            marks = () if (choice, layout) in DEFAULT else (pytest.mark.slow,)
            yield pytest.param(choice, layout, marks=marks, id=f"{choice}-{layout}")


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return make_steps(tmp_path_factory.mktemp("tuning"), FAMILY, BASE)


def _frozen_names(ref: dict) -> set:
    return set(ref["params"]) - set(ref["grads"][0])


@pytest.mark.parametrize("choice, layout", list(_params()))
def test_tuning_parity_fp64(choice, layout, steps):
    cfg = replace(BASE, modules=CHOICES[choice])
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, LAYOUTS[layout], cfg, steps, torch.float64, grads=True)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)

    tuning = tuning_of(cfg.optim)
    frozen = _frozen_names(ref)
    assert frozen == {n for n in ref["params"] if not trains(tuning, n)}
    if choice == "per-module-lr":
        assert not frozen
    else:
        assert frozen
    for rank, out in enumerate(got["per_rank"]):
        for step_grads in out["grads"]:  # frozen parameters never get a gradient
            assert not frozen & set(step_grads), (rank, sorted(frozen & set(step_grads))[:3])
        for name in frozen & set(out["params"]):  # and never change, on any rank
            assert torch.equal(out["params"][name], out["params0"][name]), (rank, name)
        trained = set(out["params"]) - frozen
        assert all(set(g) == trained for g in out["grads"]), rank
    _assert_state_is_the_plan(got, cfg, LAYOUTS[layout])


def _assert_state_is_the_plan(got: dict, cfg: TrainLoopConfig, layout: dict) -> None:
    """Each rank's measured weights / grads / masters / AdamW bytes equal the plan's."""
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.models.sizes import count_params
    from ray_dhp.step.precision import policy_of

    topo = Topology.build(**layout)
    counts = count_params(demo.tiny_model_config(FAMILY), tuning_of(cfg.optim))
    policy = policy_of(cfg.precision)
    for rank, out in enumerate(got["per_rank"]):
        want = rank_state(counts, topo, rank, policy)
        st = out["state"]
        # fp64 run: the plan counts the policy's fp32 bytes, the engine holds 8-byte tensors
        assert (st["weights"], st["grads"], st["masters"], st["optimizer"]) == \
            (2 * want.weights, 2 * want.grads, 2 * want.masters, 2 * want.optimizer), (rank, st, want)


def _resume_data_and_reference(tmp_path, cfg):
    """The resume tests' dataset (path), the reference's history + final parameters over
    ``cfg.optim.num_steps``, and the reference trainer itself."""
    from ray_dhp.step.reference import ReferenceTrainer
    from tests.distributed.checkpoint_cases import DTYPE, _sampler

    data = str(demo.make_dataset(tmp_path / "data", num_samples=16, seed=0, text_only_every=4,
                                 image_sizes=((56, 56), (84, 56), (112, 84))))
    sampler = _sampler(data, cfg)
    trainer = ReferenceTrainer(demo.tiny_model_config(FAMILY), cfg.optim, precision=cfg.precision, dtype=DTYPE)
    ref = {"history": [trainer.step(sampler.next_step()) for _ in range(cfg.optim.num_steps)],
           "params": trainer.named_parameters()}
    return data, ref, trainer


RESUME = {"frozen-vision+llm-lr": {"vision": {"train": False}, "llm": {"lr": 2e-3}},
          "frozen-llm": {"llm": {"train": False}}}


@pytest.mark.slow  # the default suite resumes a frozen-module run in the LoRA test below
@pytest.mark.parametrize("choice", ["frozen-vision+llm-lr", "frozen-llm"])
def test_resume_with_frozen_modules_is_exact(choice, tmp_path):
    """3 steps at collocated SP2/TP2 + save + resume at disjoint 1+2 + 3 steps == 6 steps of the
    reference (losses, every rank's copy of every parameter, fp64 1e-10): the optimizer and
    scheduler states of the trained parts, and the frozen weights, survive the round trip."""
    from tests.distributed.checkpoint_cases import (CFG, COLLOCATED_SP2_TP2, DISJOINT_1V_2T,
                                                    assert_matches, run)

    cfg = replace(CFG, modules=RESUME[choice])
    data, ref, _ = _resume_data_and_reference(tmp_path, cfg)
    root = str(tmp_path / "ckpts")
    first = run(COLLOCATED_SP2_TP2, data, stop=3, save_at=(3,), ckpt_root=root, cfg=cfg)
    second = run(DISJOINT_1V_2T, data, resume_from=root, cfg=cfg)
    assert second["first"] == 3
    assert_matches(first["history"] + second["history"], second, ref)


LORA = {"llm": {"lora": {"r": 4, "alpha": 8}}}


@pytest.mark.parametrize("layout", ["sp2-tp2", pytest.param("disjoint-1v-2t", marks=pytest.mark.slow),
                                    pytest.param("sp2-cp2", marks=pytest.mark.slow)])
def test_lora_parity_fp64(layout, steps):
    """PEFT LoRA on every attention and MLP linear of the language model, TP-sharded by the
    derived plan (`ray_dhp.models.lora`), against the single-process PEFT model: loss, every
    clipped gradient (the adapters' and the vision tower's), every update, every rank's copy;
    the base weights of the language model stay bit-identical."""
    cfg = replace(BASE, modules=LORA)
    ref = run_reference(FAMILY, cfg, steps, torch.float64)
    got = run_engine(FAMILY, LAYOUTS[layout], cfg, steps, torch.float64, grads=True)
    assert_parity(got, ref, loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
    trained = set(ref["grads"][0])
    lora = {n for n in ref["params"] if ".lora_" in n}
    assert lora and lora <= trained and any(n.startswith("model.visual.") for n in trained)
    assert not any(n.startswith(("model.language_model.", "lm_head")) for n in trained - lora)
    # lora_B starts at zero (PEFT's init) and moves: the adapters really train
    assert all(ref["params0"][n].abs().max() == 0 < ref["params"][n].abs().max()
               for n in lora if ".lora_B." in n)
    for rank, out in enumerate(got["per_rank"]):
        for name in set(out["params"]) - trained:
            assert torch.equal(out["params"][name], out["params0"][name]), (rank, name)
    _assert_state_is_the_plan(got, cfg, LAYOUTS[layout])


LORA_ONLY = {"vision": {"train": False}, "merger": {"train": False},
             "llm": {"lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj", "o_proj",
                                                                     "down_proj"]}}}


def test_lora_resume_and_export_merged_or_adapter(tmp_path):
    """LoRA (column- and row-parallel targets) with the vision side frozen: 3 steps at
    collocated SP2/TP2 + save + resume at disjoint 1+2 + 3 steps == 6 steps of the PEFT
    reference (fp64, 1e-10); the final checkpoint exports (a) merged into a plain transformers
    model and (b) as a PEFT adapter directory loaded with ``PeftModel.from_pretrained`` onto
    the base model; both give the reference's logits."""
    import transformers
    from peft import PeftModel

    from ray_dhp import export_hf
    from ray_dhp.models import build_model
    from tests.distributed.checkpoint_cases import (CFG, COLLOCATED_SP2_TP2, DISJOINT_1V_2T, DTYPE,
                                                    assert_matches, run)

    cfg = replace(CFG, modules=LORA_ONLY)
    data, ref, trainer = _resume_data_and_reference(tmp_path, cfg)
    root = str(tmp_path / "ckpts")
    first = run(COLLOCATED_SP2_TP2, data, stop=3, save_at=(3,), ckpt_root=root, cfg=cfg)
    second = run(DISJOINT_1V_2T, data, resume_from=root, save_at=(6,), ckpt_root=root, cfg=cfg)
    assert second["first"] == 3
    assert_matches(first["history"] + second["history"], second, ref)

    final = f"{root}/checkpoint_000006"
    ids = torch.tensor([[5, 17, 42, 7, 99, 3, 64, 11]])
    kwargs = dict(input_ids=ids, attention_mask=torch.ones_like(ids),
                  mm_token_type_ids=torch.zeros_like(ids), use_cache=False)
    with torch.no_grad():
        want = trainer.model(**kwargs).logits
    cls = getattr(transformers, "Qwen2_5_VLForConditionalGeneration")

    merged = cls.from_pretrained(export_hf(final, str(tmp_path / "merged")), dtype=DTYPE)
    assert not any(".lora_" in n or "base_layer" in n for n, _ in merged.named_parameters())
    adapter_dir = export_hf(final, str(tmp_path / "adapter"), lora="adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(adapter_dir))
    base = build_model(demo.tiny_model_config(FAMILY), seed=cfg.optim.seed, dtype=DTYPE)
    with_adapter = PeftModel.from_pretrained(base, adapter_dir)
    with torch.no_grad():
        for model in (merged, with_adapter):
            got = model(**kwargs).logits
            assert (got - want).abs().max() <= 1e-10 * want.abs().max(), (got - want).abs().max()
    with pytest.raises(ValueError, match="trained too"):  # adapters only, but the ViT trained
        from ray_dhp.models.lora import check_adapter_export
        from ray_dhp.config.tuning import parse_tuning

        check_adapter_export(parse_tuning(LORA))
