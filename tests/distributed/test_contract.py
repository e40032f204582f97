"""The transformers contract (`ray_dhp.models.contract`): a transformers older than the seam
(simulated: the model's forward without ``mm_encoder_outputs``, so the keyword falls into
``**kwargs``) fails at engine start-up, and one that accepts the keyword but ignores it fails on
the first step, both naming the minimum version."""

from __future__ import annotations

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models.contract import MIN_TRANSFORMERS
from ray_dhp.parallel.topology import Topology
from ray_dhp.config.train_loop import TrainLoopConfig
from tests.distributed.parity import make_steps
from tests.spawn import run_on_ranks

FAMILY = "qwen2_5_vl"
CFG = TrainLoopConfig(lr=1e-3, global_batch_size=4, num_steps=1, seed=0)
ONE_RANK = dict(placement="collocated", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)


def _old_forward(real):
    """transformers 5.17's shape of the seam: no ``mm_encoder_outputs`` parameter; the keyword
    lands in ``**kwargs`` and is dropped (the logits ignore the image features)."""

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None,
                inputs_embeds=None, labels=None, use_cache=None, pixel_values=None,
                image_grid_thw=None, mm_token_type_ids=None, **kwargs):
        kwargs.pop("mm_encoder_outputs", None)
        return real(self, input_ids=input_ids, attention_mask=attention_mask,
                    position_ids=position_ids, use_cache=use_cache,
                    mm_token_type_ids=mm_token_type_ids, image_grid_thw=image_grid_thw, **kwargs)
    return forward


def _ignoring_forward(real):
    """A forward that names the keyword but ignores it (what the run-time check is for)."""

    def forward(self, *args, mm_encoder_outputs=None, **kwargs):
        return real(self, *args, **kwargs)
    return forward


def _body(rank, world, steps):
    import transformers

    from ray_dhp.models import FAMILIES
    from ray_dhp.step.engine import DHPEngine
    from ray_dhp.parallel.mesh import build_groups

    cls = getattr(transformers, FAMILIES[FAMILY].model_class)
    real = cls.forward
    groups = build_groups(Topology.build(**ONE_RANK), torch.device("cpu"))
    errors = {}
    for name, make in (("old_signature", _old_forward), ("ignored", _ignoring_forward)):
        cls.forward = make(real)
        try:
            engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, CFG.step_config())
            engine.step(steps[0])
        except RuntimeError as e:
            errors[name] = str(e)
        finally:
            cls.forward = real
    engine = DHPEngine(demo.tiny_model_config(FAMILY), groups, CFG.step_config())  # the real seam: no error
    errors["real_loss"] = engine.step(steps[0])["loss"]
    return errors


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    return make_steps(tmp_path_factory.mktemp("contract"), FAMILY, CFG)


def test_a_transformers_that_ignores_mm_encoder_outputs_fails_naming_the_minimum(steps):
    assert any(s.image_grid_thw is not None for mb in steps[0] for s in mb)  # features do flow
    (errors,) = run_on_ranks(_body, 1, args=(steps,))
    assert "has no 'mm_encoder_outputs' parameter" in errors["old_signature"]
    assert "ignored mm_encoder_outputs" in errors["ignored"]
    for name in ("old_signature", "ignored"):
        assert f"transformers>={MIN_TRANSFORMERS}" in errors[name], errors[name]
    assert errors["real_loss"] > 0
