"""The engine's LoRA adapters start as PEFT's defaults (no process group, no spawn).

The engine draws ``lora_A`` from a generator seeded by the run seed and the layer name (every
rank must hold the same adapters), so it cannot call PEFT's init, which draws from the global
RNG; the single-process reference re-draws with the same generator. That seeding convention is
the one piece both share, so the *distribution* is checked here directly against PEFT's own
``get_peft_model`` (``init_lora_weights=True``: ``lora_A`` Kaiming-uniform with
``a=sqrt(5)``, i.e. U(-1/sqrt(in_features), 1/sqrt(in_features)); ``lora_B`` zero).
"""

import math

import pytest
import torch

from ray_dhp import demo
from ray_dhp.models import build_model
from ray_dhp.config.tuning import LoraChoice

pytest.importorskip("peft")

FAMILY = "qwen2_5_vl"
CHOICE = LoraChoice(r=4, alpha=8.0)


def _layers(model) -> dict:
    from peft.tuners.lora import LoraLayer

    return {n: m for n, m in model.named_modules() if isinstance(m, LoraLayer)}


def test_engine_lora_init_is_peft_default():
    from peft import LoraConfig, get_peft_model

    from ray_dhp.models.lora import ADAPTER, add_lora, target_regex

    ours = build_model(demo.tiny_model_config(FAMILY), seed=0)
    add_lora(ours, CHOICE, seed=0)
    stock = build_model(demo.tiny_model_config(FAMILY), seed=0)
    torch.manual_seed(0)
    get_peft_model(stock, LoraConfig(r=CHOICE.r, lora_alpha=CHOICE.alpha, lora_dropout=0.0,
                                     target_modules=target_regex(CHOICE.target_modules)))
    mine, theirs = _layers(ours), _layers(stock)
    assert mine.keys() == theirs.keys() and mine
    for name, layer in mine.items():
        a, b = layer.lora_A[ADAPTER].weight.detach(), layer.lora_B[ADAPTER].weight.detach()
        pa, pb = theirs[name].lora_A[ADAPTER].weight.detach(), theirs[name].lora_B[ADAPTER].weight.detach()
        assert a.shape == pa.shape and b.shape == pb.shape and a.dtype == pa.dtype, name
        assert layer.scaling[ADAPTER] == theirs[name].scaling[ADAPTER] == CHOICE.alpha / CHOICE.r
        assert not b.any() and not pb.any(), name  # B = 0: the adapted model starts as the base
        # kaiming_uniform_(a=sqrt(5)): gain sqrt(2 / (1 + 5)), bound gain * sqrt(3 / fan_in)
        bound = math.sqrt(2.0 / 6.0) * math.sqrt(3.0 / a.shape[1])
        assert bound == pytest.approx(1 / math.sqrt(layer.in_features))
        for w, who in ((a, "engine"), (pa, "peft")):
            # uniform on [-bound, bound]: nothing beyond it, the max of >= 128 draws near it,
            # standard deviation bound / sqrt(3) (within 25 %: >= 128 draws, deterministic seeds)
            top = float(w.abs().max())
            assert 0.9 * bound <= top <= bound, f"{who} {name}: max |lora_A| {top}, PEFT's bound {bound}"
            assert float(w.std()) == pytest.approx(bound / math.sqrt(3), rel=0.25), (who, name)
        assert not torch.equal(a, pa)  # really two draws (the engine's is per-name seeded)
