"""A generic family's mixture-of-experts language model, read from transformers' own metadata
(`ray_dhp.models.generic`): the `MoESpec` the engine's MoE mechanisms take (the router's
load-balancing loss, `ray_dhp.models.moe`; expert parallelism, `ray_dhp.parallel.expert`), with
nothing written for the family.

What is read, and from where:

* **The experts modules**: the keys of the language model's ``base_model_ep_plan`` styled
  ``ep_dispatch_experts`` (else its ``base_model_tp_plan``'s ``moe_tp_experts``), e.g.
  ``layers.*.mlp.experts``. Under text tensor parallelism they are *replicated* on every TP rank
  (their entries, ``packed_colwise`` / ``rowwise`` on the fused weights, are dropped from the
  plan, `dense_plan`): their input is the replicated residual stream, so every TP rank computes
  the whole routed part on the same tokens, with the same outputs and whole gradients (no
  reduction), as in the hand-written MoE families. Shared experts are dense MLPs and keep their
  ``colwise`` / ``rowwise`` entries.
* **The sparse layers**: the decoder layers that hold an experts module in the language model
  built on the meta device from the text config (no memory).
* **The routers**: the class the language model records ``router_logits`` from (its
  ``_can_record_outputs``, an ``OutputRecorder`` with the output's index), found by name under a
  decoder layer (e.g. ``mlp.gate``): the logits the stock ``load_balancing_loss_func`` reads.
* **Counts**: experts ``num_local_experts`` (else ``num_experts``), top-k ``num_experts_per_tok``,
  the coefficient ``router_aux_loss_coef`` — the values the stock forward passes.
* **Whether there is a load-balancing loss**: the stock forward takes ``output_router_logits``
  and the config has a ``router_aux_loss_coef``; a model whose forward has none (auxiliary-loss-
  free routing, DeepSeek-V3's and Kimi-K2.5's; Llama 4's) trains on the cross-entropy alone, as
  its stock model does.
* **Expert parallelism**: covered where the experts class is transformers' common experts
  interface in the layout the EP forward computes (``use_experts_implementation`` with
  concatenated, untransposed ``gate_up_proj [E, 2I, H]`` / ``down_proj [E, H, I]``, no bias, the
  default ``act(gate) * up``, ``forward(hidden_states, top_k_index, top_k_weights)``); otherwise
  refused in the driver with the reason (`MoESpec.ep_refusal`) and the experts stay replicated.
"""

from __future__ import annotations

import fnmatch
import functools
import inspect
import re

import torch

from ray_dhp.models.base import MoESpec

__all__ = ["COUNT_KEYS", "expert_count", "expert_widths", "moe_spec", "dense_plan", "unreached"]

#: the text-config keys transformers names the number of routed experts with
COUNT_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
_EP_INTERFACE = ("hidden_states", "top_k_index", "top_k_weights")


def expert_count(text_config) -> int:
    """The number of routed experts of ``text_config`` (0: a dense model)."""
    return max((getattr(text_config, k, 0) or 0 for k in COUNT_KEYS
                if isinstance(getattr(text_config, k, 0) or 0, int)), default=0)


def expert_widths(text_config) -> tuple:
    """The routed experts' intermediate widths, one per group of experts: ``moe_intermediate_size``
    is an int, or a list where the model routes each modality's tokens to its own group (ERNIE-4.5-
    VL's ``[text, vision]``: ``text_moe`` / ``vision_moe``, each ``num_experts`` wide); ``()`` for
    a dense model."""
    width = getattr(text_config, "moe_intermediate_size", None)
    if width is None and expert_count(text_config) > 1 and any(
            getattr(text_config, k, None) is not None
            for k in ("intermediate_size_mlp", "dense_intermediate_size")):
        # Llama 4's / MiniMax-M3's: their dense MLPs' width is intermediate_size_mlp /
        # dense_intermediate_size
        width = text_config.intermediate_size
    if width is None:
        return ()
    return tuple(width) if isinstance(width, (list, tuple)) else (width,)


def expert_patterns(text_config) -> tuple:
    """The experts modules' keys (relative to the language model) in its EP / TP plan."""
    for attr, style in (("base_model_ep_plan", "ep_dispatch_experts"),
                        ("base_model_tp_plan", "moe_tp_experts")):
        keys = tuple(k for k, v in (getattr(text_config, attr, None) or {}).items() if v == style)
        if keys:
            return keys
    return ()


def dense_plan(plan: dict, patterns: tuple) -> dict:
    """``base_model_tp_plan`` without the entries of the experts modules and their weights (the
    experts stay replicated over TP, module docstring)."""
    return {k: v for k, v in plan.items()
            if not any(k == p or k.startswith(p + ".") for p in patterns)}


def moe_spec(cls, config, lm_cls):
    """``(MoESpec or None, experts patterns)`` of ``config``'s language model (class ``lm_cls``);
    raises ValueError saying why a mixture-of-experts LM cannot be described."""
    text = config.get_text_config()
    n = expert_count(text)
    patterns = expert_patterns(text)
    if n <= 1 and not patterns:
        return None, ()
    if not patterns:
        raise ValueError(f"its language model has {n} experts but its base_model_ep_plan / "
                         "base_model_tp_plan names no experts module")
    if n < 1 and not _matching(_meta_lm(lm_cls, text.to_json_string(use_diff=False)), patterns):
        return None, ()  # a plan for the family's MoE variants; this config builds none (Gemma 4's)
    if n < 1:
        raise ValueError(f"its base_model_ep_plan / base_model_tp_plan names experts modules "
                         f"{patterns} but its config gives no number of experts ({COUNT_KEYS})")
    key = next(k for k in COUNT_KEYS if getattr(text, k, None) == n)
    lm = _meta_lm(lm_cls, text.to_json_string(use_diff=False))
    experts = _matching(lm, patterns)
    recorder = (getattr(lm_cls, "_can_record_outputs", None) or {}).get("router_logits")
    router_cls = getattr(recorder, "target_class", recorder)
    routers = [n_ for n_, m in lm.named_modules()
               if isinstance(router_cls, type) and isinstance(m, router_cls)]
    suffixes = {_under_layer(n_) for n_ in routers}
    if len(suffixes) != 1 or None in suffixes:
        raise ValueError(f"its language model records router_logits from {router_cls!r}, found "
                         f"under the decoder layers as {sorted(map(str, suffixes))}: one router "
                         "per sparse layer is needed")
    exp_suffixes = {_under_layer(n_) for n_ in experts}
    aux = "output_router_logits" in inspect.signature(cls.forward).parameters \
        and getattr(text, "router_aux_loss_coef", None) is not None
    spec = MoESpec(router_suffix=suffixes.pop(),
                   experts_suffix=exp_suffixes.pop() if len(exp_suffixes) == 1 else "experts",
                   sparse_layers=functools.partial(sparse_layers, lm_cls, patterns),
                   router_output=getattr(recorder, "index", 0) or 0, experts_key=key,
                   aux_loss=aux, ep_refusal=_ep_refusal(lm, experts))
    return spec, patterns


def unreached(config, lm_cls, patterns: tuple) -> tuple:
    """Parameter names (``layers.*.`` for any layer) of the language model that its text forward
    gives no gradient: none after a backward of a copy of small widths and two layers run on CPU
    (ERNIE-4.5-VL's vision experts, called only on the tokens a ``moe_mm_token_type_ids`` marks,
    which the engine does not pass; Mistral Large 4's attention indexer, which only picks keys).
    The stock model never steps them (AdamW skips a parameter without a gradient), so the engine
    holds them frozen. An experts module (``patterns``) with a gradient counts as reached whole
    (the experts a batch routes no token to are its parts, or slices of its fused weights)."""
    from ray_dhp.models.shrink import shrink_config

    small = shrink_config(config, text={"num_hidden_layers": 2}).get_text_config()
    small._attn_implementation = "eager"
    torch.manual_seed(0)
    try:
        lm = lm_cls._from_config(small, dtype=torch.float32)
        ids = torch.arange(8).reshape(1, 8) % small.vocab_size
        lm(input_ids=ids, use_cache=False).last_hidden_state.float().square().sum().backward()
    except Exception:  # noqa: BLE001 - no small copy runs: nothing is known unreached (the
        return ()      # engine then steps every parameter, as before this check)
    experts = [lm.get_submodule(e) for e in _matching(lm, patterns)]
    reached = {id(p) for e in experts if any(q.grad is not None for q in e.parameters())
               for p in e.parameters()}

    def key(name: str) -> str:
        return re.sub(r"^layers\.\d+\.", "layers.*.", name)

    seen, missed = set(), set()
    for name, p in lm.named_parameters():
        hit = p.grad is not None or not p.requires_grad or id(p) in reached
        (seen if hit else missed).add(key(name))
    return tuple(sorted(missed - seen))


def sparse_layers(lm_cls, patterns: tuple, text_config) -> list:
    """Indices of the decoder layers holding an experts module (the LM built on meta)."""
    lm = _meta_lm(lm_cls, text_config.to_json_string(use_diff=False))
    return sorted({int(re.match(r"layers\.(\d+)\.", n).group(1)) for n in _matching(lm, patterns)})


@functools.lru_cache(maxsize=8)
def _meta_lm(lm_cls, text_json: str) -> torch.nn.Module:
    import json

    text = lm_cls.config_class.from_dict(json.loads(text_json))
    with torch.device("meta"):
        return lm_cls._from_config(text)


def _matching(lm, patterns: tuple) -> list:
    return [n for n, _ in lm.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in patterns)]


def _under_layer(name: str):
    """``layers.3.mlp.gate`` -> ``mlp.gate`` (None outside the decoder layers)."""
    m = re.match(r"layers\.\d+\.(.+)$", name)
    return m.group(1) if m else None


def _ep_refusal(lm, experts: list) -> str:
    """Why `ray_dhp.parallel.expert`'s forward would not be the experts' own ("": covered)."""
    from transformers.integrations.moe import _default_apply_gate

    m = lm.get_submodule(experts[0])
    why = f"its experts class {type(m).__name__}"
    flags = {k: getattr(m, k, None) for k in ("is_transposed", "is_concatenated", "has_bias",
                                              "has_gate", "has_post_expert_norm")}
    if flags != {"is_transposed": False, "is_concatenated": True, "has_bias": False,
                 "has_gate": True, "has_post_expert_norm": False}:
        return (f"{why} is not transformers' experts interface with concatenated, untransposed "
                f"gate_up_proj / down_proj and no bias ({flags})")
    names = tuple(inspect.signature(type(m).forward).parameters)[1:]
    params = {n: tuple(p.shape) for n, p in m.named_parameters(recurse=False)}
    if names != _EP_INTERFACE or set(params) != {"gate_up_proj", "down_proj"}:
        return f"{why} takes {names} and holds {sorted(params)}"
    (e, i2, h), (e2, h2, i) = params["gate_up_proj"], params["down_proj"]
    if e != e2 or h != h2 or i2 != 2 * i:
        return f"{why} has gate_up_proj {params['gate_up_proj']}, down_proj {params['down_proj']}"
    if getattr(type(m), "_apply_gate", None) is not _default_apply_gate:
        return f"{why} has its own gate activation (_apply_gate), not act(gate) * up"
    return ""
