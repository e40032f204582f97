"""PEFT LoRA adapters on the language model, exact under tensor parallelism.

The adapters are PEFT's own (``peft.inject_adapter_in_model``: each targeted ``nn.Linear``
becomes a ``peft.tuners.lora.Linear`` holding the original as ``base_layer`` and the adapter as
``lora_A.default`` / ``lora_B.default``), so the model computes PEFT's
``y = base(x) + lora_B(lora_A(x)) * alpha / r`` (dropout 0). They are injected after the base
weights are loaded and TP-sharded (the base layer keeps its ``ColwiseParallel`` /
``RowwiseParallel`` hooks), and the adapter sub-modules then get a TP plan derived, as data, from
the base's style (`lora_tp_plan`):

* column-parallel base (q/k/v, gate/up: the output is sharded over TP): ``lora_A`` replicated,
  ``lora_B`` column-parallel. Every rank computes the full ``h = x A^T`` and its slice of the
  output, ``h B_local^T``. ``lora_B``'s input hook makes ``h`` a replicated DTensor, so in
  backward the partial ``dh`` (each rank's ``B_local``) is all-reduced there: ``dA = dh^T x`` and
  the LoRA path's ``dx`` are then complete and identical on every rank.
* row-parallel base (o/down: the input is sharded, the output all-reduced): ``lora_A``
  row-parallel (``h = all_reduce(x_local A_local^T)``, full on every rank), ``lora_B``
  replicated (``h B^T`` is the full output, as the base's).

The adapter weights are initialised like PEFT's defaults (``lora_A`` Kaiming-uniform, bound
``1/sqrt(in_features)``; ``lora_B`` zero), drawn from a generator seeded by the run seed and
the parameter name, so every rank and the single-process reference hold the same values.
Text sequence parallelism is not covered (its row-parallel layers reduce-scatter into a sequence
shard): the driver refuses the combination.

Mixture-of-experts LMs: the targets match the attention's linears, the dense layers' MLP and a
shared expert's (``mlp.shared_expert.{gate,up,down}_proj``, Qwen3.5-MoE: TP-sharded like a dense
MLP, so its adapters get the same plan). The router (``mlp.gate``, a top-k module holding a
weight) and the fused experts (``mlp.experts.gate_up_proj [E, 2I, H]``: 3-D parameters, no
``nn.Linear`` to wrap) are not targets: they stay frozen with the base, and naming them is refused
in the driver (`ray_dhp.config.tuning`).
"""

from __future__ import annotations

import re
import zlib

import torch

ADAPTER = "default"


def target_regex(targets) -> str:
    """PEFT ``target_modules`` (a full-match regex): the named linears of the language model's
    decoder layers only (the vision tower has linears of the same names)."""
    names = "|".join(re.escape(t) for t in targets)
    return rf"(.*\.)?language_model\.layers\.\d+\.(self_attn|mlp|mlp\.shared_expert)\.({names})"


def peft_config(choice):
    """The ``peft.LoraConfig`` of a `ray_dhp.config.tuning.LoraChoice` (dropout 0, no bias)."""
    from peft import LoraConfig

    return LoraConfig(r=choice.r, lora_alpha=choice.alpha, lora_dropout=0.0, bias="none",
                      target_modules=target_regex(choice.target_modules))


def inject(model: torch.nn.Module, choice, seed: int) -> None:
    """Add the adapters to ``model`` (the full model or the text shard, possibly TP-sharded
    already) and initialise them from ``seed`` (see the module docstring)."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(peft_config(choice), model, adapter_name=ADAPTER)
    for name, module in lora_layers(model):
        # full-size adapters (PEFT sizes them by a TP-sharded base's local shard), sharded
        # afterwards by `lora_tp_plan`
        base = module.base_layer
        dev, dtype, r = base.weight.device, base.weight.dtype, choice.r
        a = torch.nn.Linear(base.in_features, r, bias=False, device=dev, dtype=dtype)
        b = torch.nn.Linear(r, base.out_features, bias=False, device=dev, dtype=dtype)
        with torch.no_grad():
            a.weight.copy_(_uniform(a.weight.shape, seed, name, dtype))
            b.weight.zero_()
        module.lora_A[ADAPTER], module.lora_B[ADAPTER] = a, b
        module.in_features, module.out_features = base.in_features, base.out_features


def _uniform(shape, seed: int, name: str, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    bound = 1.0 / shape[1] ** 0.5
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 2 - 1).mul_(bound).to(dtype)


def lora_layers(model: torch.nn.Module) -> list:
    """``(name, peft lora layer)`` of ``model``."""
    from peft.tuners.lora import LoraLayer

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def lora_tp_plan(base_plan: dict, targets) -> dict:
    """The adapters' TP plan derived from the base plan (see the module docstring): for each
    targeted column-parallel pattern ``P``, ``P.lora_B.default`` column-parallel; for each
    row-parallel one, ``P.lora_A.default`` row-parallel. Other styles are refused."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for pattern, style in base_plan.items():
        if pattern.rsplit(".", 1)[-1] not in targets:
            continue
        if type(style) is ColwiseParallel:
            plan[f"{pattern}.lora_B.{ADAPTER}"] = ColwiseParallel()
        elif type(style) is RowwiseParallel or type(style).__name__ == "OwnedRowwise":
            plan[f"{pattern}.lora_A.{ADAPTER}"] = RowwiseParallel()
        else:
            raise ValueError(f"LoRA on {pattern}: no adapter plan for {type(style).__name__}")
    return plan


def counting_plan(base_plan: dict, targets) -> dict:
    """The plan by parameter-owning module after injection (``P`` -> ``P.base_layer``), plus
    the adapters': what `ray_dhp.models.sizes.count_params` classifies sharded parameters with."""
    plan = {}
    for pattern, style in base_plan.items():
        key = f"{pattern}.base_layer" if pattern.rsplit(".", 1)[-1] in targets else pattern
        plan[key] = style
    plan.update(lora_tp_plan(base_plan, targets))
    return plan


def add_lora(model: torch.nn.Module, choice, seed: int, tp_mesh=None, base_plan=None) -> None:
    """Inject the adapters into ``model`` and, with ``tp_mesh``, shard them by `lora_tp_plan`."""
    inject(model, choice, seed)
    if tp_mesh is not None:
        from ray_dhp.parallel.tensor import apply_tp_plan

        apply_tp_plan(model, tp_mesh, lora_tp_plan(base_plan, choice.target_modules))


# -- export --------------------------------------------------------------------------------------

LORA_EXPORTS = ("merge", "adapter")


def split_tensors(tensors: dict) -> tuple:
    """(base tensors by the plain transformers names, adapter tensors by their PEFT names)."""
    base, adapters = {}, {}
    for name, t in tensors.items():
        if ".lora_A." in name or ".lora_B." in name:
            adapters[name] = t
        else:
            base[name.replace(".base_layer.", ".")] = t
    return base, adapters


def merged_tensors(tensors: dict, choice) -> dict:
    """The plain model's tensors with every adapter merged: ``W + (alpha / r) B A`` (PEFT's
    merge, computed in fp64 and rounded once to the weight's dtype)."""
    base, adapters = split_tensors(tensors)
    scaling = choice.alpha / choice.r
    for name in [n for n in adapters if ".lora_A." in n]:
        layer = name.split(".lora_A.")[0]
        a, b = adapters[name], adapters[name.replace(".lora_A.", ".lora_B.")]
        w = base[f"{layer}.weight"]
        base[f"{layer}.weight"] = (w.double() + scaling * (b.double() @ a.double())).to(w.dtype)
    return base


def write_adapter_dir(model, adapters: dict, choice, out: str, source=None) -> None:
    """A PEFT adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``) of the
    adapters, written by PEFT itself (``PeftModel.save_pretrained``) for the plain ``model``;
    it loads with ``PeftModel.from_pretrained(base_model, out)``."""
    from peft import get_peft_model

    config = peft_config(choice)
    config.base_model_name_or_path = source
    peft_model = get_peft_model(model, config, adapter_name=ADAPTER)
    state = {f"base_model.model.{n}": t.to(next(peft_model.parameters()).dtype)
             for n, t in adapters.items()}
    result = peft_model.load_state_dict(state, strict=False)
    if result.unexpected_keys:
        raise ValueError(f"adapter tensors unknown to the PEFT model: {result.unexpected_keys[:5]}")
    peft_model.save_pretrained(out)


def check_adapter_export(tuning) -> None:
    """An adapter directory holds only the adapters: refuse it when other parts trained too."""
    trained = [m for m in ("vision", "merger") if tuning.choice(m).train]
    if trained:
        raise ValueError(f"lora='adapter' writes only the LoRA adapters, but {' and '.join(trained)} "
                         f"trained too (modules.{trained[0]}.train is true): export with "
                         f"lora='merge' (a full model), or freeze them in the run.")
