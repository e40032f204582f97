"""The router's load-balancing loss of a mixture-of-experts LM, exact under data parallelism.

What is matched: transformers' ``load_balancing_loss_func`` (Switch Transformer eqs. 4-6) as the
stock ``Qwen3VLMoeForConditionalGeneration`` computes it for ONE forward over a padded batch with
its ``attention_mask``: the statistics are taken over every real (non-padding) token of the
batch — prompt, image and answer tokens alike, not only the targets — pooled over all sparse
layers::

    aux = E * sum_e  (C_e / (L N)) * (P_e / (L N))

with ``C_e`` the number of top-k assignments to expert ``e`` and ``P_e`` the sum of its softmax
probabilities, both summed over the ``L`` sparse layers and the ``N`` real tokens. ``C`` has no
gradient (top-k counts), so the gradient flows through ``P`` only.

The batch is the **micro-batch** (all its rows, over every text data-parallel replica): the
engine's micro-batches are data, the same on every layout, and each is what the reference feeds
the stock model in one forward. A step's loss is the token-normalised cross-entropy plus
``router_aux_loss_coef * mean over the step's micro-batches of aux`` (with one micro-batch per
step: exactly the stock model's ``loss`` for the global batch). Each replica sees only its rows,
so it all-reduces ``C`` (per layer) and ``N`` over the text data-parallel group (one small
all-reduce per micro-batch, on the device) and contributes
``E * sum_e (C_e / (L N)) * (P_e^local / (L N))``: the contributions sum to ``aux`` exactly and,
``C`` and ``N`` being global constants, so do their gradients. Text TP ranks compute the router on
the same (replicated) tokens and contribute the same value, like the cross-entropy.
Arithmetic as in transformers: fp32 sums of the fp32-cast probabilities.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

__all__ = ["RouterTap", "aux_contribution"]


class RouterTap:
    """Forward hooks on every router of ``model`` (modules named ``*.<spec.router_suffix>``; with
    ``layers``, only those under ``layers.<i>.`` for ``i`` in it: a dense layer's module of the
    same name, ERNIE-4.5-VL's ``mlp``, is no router):
    while ``recording``, each call's router logits ``[tokens, E]`` (its output
    ``spec.router_output``) are appended to ``logits`` (layer order: the order of the forward)."""

    def __init__(self, model: torch.nn.Module, spec, layers=None):
        self.logits: list = []
        self.recording, self.index = False, spec.router_output
        sparse = None if layers is None else {int(i) for i in layers}
        self.routers = [m for n, m in model.named_modules() if n.endswith("." + spec.router_suffix)
                        and (sparse is None or _layer_of(n, spec.router_suffix) in sparse)]
        for m in self.routers:
            m.register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        if self.recording:
            self.logits.append(output[self.index])

    def take(self) -> list:
        out, self.logits = self.logits, []
        return out


def _layer_of(name: str, suffix: str):
    """``...layers.3.mlp.gate`` -> 3 (None where the module is not ``layers.<i>.<suffix>``)."""
    head = name[:-len(suffix) - 1].rsplit(".", 2)
    return int(head[-1]) if len(head) >= 2 and head[-2] == "layers" and head[-1].isdigit() else None


def aux_contribution(logits: list, token_mask: torch.Tensor, num_experts: int, top_k: int,
                     group: Optional[dist.ProcessGroup]):
    """This replica's share of the micro-batch's load-balancing loss (see the module docstring),
    and the global per-layer expert loads ``[L, E]`` (fp32 counts, no gradient).

    ``logits``: the sparse layers' router logits of this replica's rows (flattened ``[R * S, E]``,
    row-major as the model flattens them); ``token_mask``: ``[R, S]`` True on real tokens;
    ``group``: the text data-parallel group (None: this replica holds the whole batch). Collective
    over ``group`` on every call (every replica calls it once per micro-batch)."""
    dev = logits[0].device
    flat = token_mask.reshape(-1).to(device=dev, dtype=torch.float32)
    counts, prob_sum = [], torch.zeros(num_experts, dtype=torch.float32, device=dev)
    for layer in logits:
        weights = torch.softmax(layer, dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts.append(torch.zeros(num_experts, dtype=torch.float32, device=dev).scatter_add_(
            0, chosen.reshape(-1), flat.repeat_interleave(top_k)))
        prob_sum = prob_sum + (weights.float() * flat.unsqueeze(-1)).sum(dim=0)
    stats = torch.cat([torch.stack(counts).reshape(-1), flat.sum().reshape(1)]).detach()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(stats, group=group)
    loads = stats[:-1].view(len(logits), num_experts)
    total_rows = stats[-1] * len(logits)
    tokens_per_expert = loads.sum(0) / total_rows
    value = torch.sum(tokens_per_expert * (prob_sum / total_rows)) * num_experts
    return value, loads


class RouterLoss:
    """The engine's seam for the load-balancing loss: records the routers of each training
    forward and turns them into this replica's weighted contribution
    ``router_aux_loss_coef * aux_contribution / micro_batches``; keeps the step's metrics."""

    def __init__(self, language_model: torch.nn.Module, spec, text_config,
                 group: Optional[dist.ProcessGroup]):
        self.tap = RouterTap(language_model, spec, spec.sparse_layers(text_config))
        self.num_experts = getattr(text_config, spec.experts_key)
        self.top_k = text_config.num_experts_per_tok
        self.coef, self.group = float(text_config.router_aux_loss_coef), group
        self.reset()

    def reset(self) -> None:
        self.aux_sum, self.load_ratio = 0.0, 0.0  # sum of weighted contributions; max load/mean

    def record(self, on: bool) -> None:
        self.tap.recording = on
        if on:
            self.tap.logits = []

    def contribution(self, token_mask: torch.Tensor, micro_batches: int) -> torch.Tensor:
        """Collective over the text data-parallel group (once per micro-batch on every replica)."""
        self.record(False)
        value, loads = aux_contribution(self.tap.take(), token_mask, self.num_experts, self.top_k,
                                        self.group)
        out = value * (self.coef / micro_batches)
        self.aux_sum = self.aux_sum + value.detach().double() / micro_batches
        ratio = (loads.amax(1) / loads.mean(1).clamp_min(1e-30)).amax()
        self.load_ratio = torch.maximum(torch.as_tensor(self.load_ratio, device=ratio.device), ratio)
        return out
