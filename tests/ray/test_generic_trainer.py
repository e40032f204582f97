"""Every family through the public trainer (issue #41): `DisaggregatedTrainer` with nothing written
for a generic family (`ray_dhp.models.generic`), and the hand-written families no other trainer
test trains exactly (InternVL3 and InternVL3.5, the Qwen2.5-Omni and Qwen3-Omni thinkers with
their audio group), at `tests.ray.family_runs.degrees` (vision DP2 + text TP2 collocated on 2
workers; the Omni thinkers vision SP2 + audio DP2 + text TP2), fp64, trains every step's loss equal
to the single-process stock model's on the same samples (rel 1e-10, or the family's
`family_runs.TOL`, each with its reason). The driver's checks (the model, the processor, the
layout) run on the generic family as on a hand-written one. Every case is ``-m slow`` (a Ray fit
each, ~30 s on 2 idle cores, ~2 min on a loaded machine); the default run keeps their parts: every
family's fp64 parity through the engine (``tests/distributed/test_families.py``), a model
directory loaded sharded with its own processor through the engine
(``tests/distributed/test_generic.py``), the driver's processor checks
(``tests/unit/test_model_processor.py``, ``test_processor_fit.py``) and the trainer's own path
(``tests/ray/test_mixture.py``, ``test_fault_tolerance.py``). The same families through
``ray-dhp train RUN.yaml``: ``test_cli_families.py``.

`test_trainer_trains_a_model_directory_with_its_own_processor`: what a user does with a downloaded
checkpoint — ``DHPConfig(model=<directory>)`` and nothing else: the weights, and the samples made
by the model's own transformers processor in that directory (`ray_dhp.data.model_processor`:
Gemma 3's turn format, begin/end-of-image tokens and bidirectional image attention), train
exactly as the stock model from the same directory on the same processor's samples."""

from __future__ import annotations

import pytest
import torch

from tests.ray.family_runs import (GENERIC_FAMILIES, TOL, assert_losses, family_data, family_trainer,
                                   reference_losses)

#: hand-written families trained here too: InternVL (InternViT tiles, no generic test trained it
#: through the trainer), InternVL3.5 (the demo's ``internvl3_5``: a Qwen3 LM, its per-head q/k
#: norms all-reduced under TP) and the Omni thinkers with their audio group (`family_runs.degrees`)
HAND = ("internvl", "internvl3_5", "qwen2_5_omni", "qwen3_omni_moe")


@pytest.mark.slow  # all slow: see the module docstring
@pytest.mark.parametrize("family", GENERIC_FAMILIES + HAND)
def test_trainer_trains_a_family_exactly(family, tmp_path, ray_start):
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.train.callbacks import read_history
    from tests.ray.private_run import LOOP

    cfg = TrainLoopConfig(**LOOP)
    data, steps = family_data(tmp_path, family, cfg)
    ref = reference_losses(family, cfg, steps, torch.float64)
    assert len(ref) == LOOP["num_steps"]
    history = read_history(family_trainer(family, str(data), str(tmp_path / "runs"), LOOP).fit())
    assert_losses(history, ref, TOL.get(family, 1e-10))


@pytest.mark.parametrize("family", [pytest.param("gemma3", marks=pytest.mark.slow),
                                    pytest.param("llava", marks=pytest.mark.slow)])
def test_trainer_trains_a_model_directory_with_its_own_processor(family, tmp_path, ray_start):
    from ray_dhp.config.train_loop import TrainLoopConfig
    from ray_dhp.data.model_processor import ModelProcessor, run_processor
    from ray_dhp.demo.model_dirs import model_dir
    from ray_dhp.train.callbacks import read_history
    from tests.ray.private_run import LOOP

    path = str(tmp_path / "model")
    config = model_dir(family, path, weights=True, seed=3)
    processor = run_processor(path, path)
    assert isinstance(processor, ModelProcessor)
    cfg = TrainLoopConfig(**LOOP)
    data, steps = family_data(tmp_path, family, cfg, processor=processor)
    assert any(int((s.mm_token_type_ids == 1).sum()) for mb in steps[0] for s in mb)
    ref = reference_losses(family, cfg, steps, torch.float64, model=path)
    history = read_history(family_trainer(family, str(data), str(tmp_path / "runs"), LOOP, path).fit())
    assert_losses(history, ref, TOL.get(family, 1e-10))
    assert config.image_token_id != demo_image_token_id()


def demo_image_token_id() -> int:
    """The demo tokenizer's ``<|image_pad|>`` (the directory's image token is another)."""
    from ray_dhp.demo import build_tokenizer

    return build_tokenizer().convert_tokens_to_ids("<|image_pad|>")

