"""ZeRO-3's units of another dtype (`ray_dhp.parallel.fsdp._odd_dtype`): FSDP2 gathers one dtype per
unit, so a module whose own parameters are of another dtype than its unit's (an fp32 router in an
fp64 layer, an fp32 rotary parameter beside the root's final norm: Mistral Large 4) becomes a unit
of its own, the outermost such module only, and one already inside a unit is not taken twice by
the root."""

import torch
from torch import nn

from ray_dhp.parallel.fsdp import _odd_dtype


class _Rotary(nn.Module):
    def __init__(self):
        super().__init__()
        self.alpha = nn.Parameter(torch.ones(2, dtype=torch.float32))


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(4, 4, dtype=torch.float64)
        self.gate = nn.Linear(4, 2, bias=False, dtype=torch.float32)  # a router kept in fp32


class _LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])
        self.norm = nn.LayerNorm(4, dtype=torch.float64)
        self.rotary_emb = _Rotary()


def test_the_roots_fp32_parameter_and_each_layers_router_are_units_of_their_own():
    lm = _LM()
    got = _odd_dtype(list(lm.layers), lm)
    assert [id(m) for m in got] == [id(lm.layers[0].gate), id(lm.layers[1].gate), id(lm.rotary_emb)]


def test_a_uniform_model_has_none():
    lm = _LM().to(torch.float64)
    assert _odd_dtype(list(lm.layers), lm) == []


def test_a_module_whose_only_parameter_slot_was_dropped_is_no_unit():
    """A text shard drops the vision-side parameters it does not hold by setting their slots to
    None (LLaVA-NeXT's ``image_newline`` on the model that also holds the language model): such a
    module has no parameter of another dtype, and taking it as a unit would shard every unit
    under it twice (FSDP2: "Cannot concatenate overlapping meshes")."""
    class _Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = _LM().to(torch.float64)
            self.register_parameter("image_newline", None)

    outer = _Outer()
    assert _odd_dtype(list(outer.lm.layers), outer) == []
