"""Megatron sequence parallelism for a generic family's language model, derived from its own
``base_model_tp_plan`` and module tree (`ray_dhp.models.generic`), with nothing written for the
family.

Between the plan's tensor-parallel regions the residual stream is this rank's sequence shard.
What is read, and from where (the decoder built on the meta device, layer by layer):

* **The regions**: the children of a decoder layer that hold plan entries (``self_attn``,
  ``mlp``, ``feed_forward``, ...). A region whose entries are ``colwise`` linears it owns and one
  ``rowwise`` linear is a Megatron region: `GatheredColwise` (one all-gather, each linear keeps
  only the sequence shard for its weight gradient) and the row-parallel linear reduce-scatters
  into the shard. Any other region (GLM's fused ``gate_up_proj`` styled ``colwise_gather_output``,
  an MLA's replicated ``q_a_proj`` / ``mla_kv_a_proj``) runs on the gathered sequence under its
  own TP styles (`GatheredRegion`), its row-parallel linear reduce-scattering; a sparse block
  (it holds the experts module, replicated over the TP ranks) runs on the gathered sequence and
  its whole output is sliced (as the hand-written Qwen3.5-MoE's).
* **The norms**: every other child of a decoder layer must be a per-token norm (each parameter
  one ``[hidden]`` vector, e.g. Gemma 3's four) or hold no parameters; the norms run on the
  local tokens (DTensor ``SequenceParallel``, their gradients summed over the TP ranks). The
  language model's own such children besides the embedding (its final norm) run on the shard
  after the layers (`AfterLayers` raises if the model calls one before them).
* **The ends**: the vocabulary-parallel embedding as under TP; the first layer's input is sliced
  (`ShardSequence`: the model builds masks, positions and the image-token placement on the whole
  sequence first; attention meets them after the all-gather); ``lm_head`` all-gathers the shard
  (logits vocabulary-sharded for the parallel loss, as under TP).

Refused (`sp_layout` returns the reason, the driver says it): a plan that shards nothing in the
decoder layers (LFM2's: only the embedding), a decoder-layer child outside the regions that is
not a per-token norm (LFM2's short convolution, which mixes tokens), a region without exactly one
row-parallel linear.
"""

from __future__ import annotations

import fnmatch

import torch

__all__ = ["sp_layout", "hf_sp_plan"]

_COLUMN, _ROW = ("colwise",), ("rowwise", "rowwise_split_input")
_IGNORED = ("replicated_with_grad_allreduce",)  # per-head norms: gradients summed by the engine


def _is_norm(module: torch.nn.Module, hidden: int) -> bool:
    params = list(module.parameters())
    return all(p.dim() == 1 and p.shape[0] == hidden for p in params)


def _layer_list(plan: dict) -> str:
    names = {k.split(".*.")[0] for k in plan if ".*." in k}
    return names.pop() if len(names) == 1 else ""


def _region(layer, i: int, lst: str, child: str, plan: dict, experts: set) -> tuple:
    """``(kind, entries)`` of region ``child`` of layer ``i``: ``entries`` ``((path under the
    region, style), ...)`` present in the layer; kind ``megatron`` / ``gathered`` / ``sparse``,
    or ``("refused", why)``."""
    entries = []
    for key, style in plan.items():
        head = f"{lst}.*.{child}."
        if key.startswith(head) and style not in _IGNORED:
            rest = key[len(head):]
            try:
                layer.get_submodule(f"{child}.{rest}")
            except AttributeError:
                continue
            entries.append((rest, style))
    entries = tuple(entries)
    under = f"{lst}.{i}.{child}."
    if any(n.startswith(under) for n in experts):
        return "sparse", entries
    if not entries:  # the region's entries match nothing in this layer: an ordinary child
        return "norm", ()
    rows = [r for r, s in entries if s in _ROW]
    if len(rows) != 1:
        return "refused", (f"decoder layer {i}'s {child} has {len(rows)} row-parallel linears in "
                           "the plan (one is needed to return its output to the sequence shard)")
    if all(s in _COLUMN + ("rowwise",) and "." not in r
           and isinstance(layer.get_submodule(f"{child}.{r}"), torch.nn.Linear) for r, s in entries):
        return "megatron", entries
    return "gathered", entries


def sp_layout(lm, plan: dict, experts: tuple, hidden: int):
    """``(layout, "")`` for `hf_sp_plan`, or ``(None, why)``: ``lm`` the decoder (meta device),
    ``plan`` its present ``base_model_tp_plan`` less the experts' entries, ``experts`` the experts
    modules' patterns (`ray_dhp.models.generic_moe`), ``hidden`` the residual width. ``layout``:
    ``(layer list, per-layer ((norm children), ((region, kind, entries), ...)), LM-level norms)``."""
    lst = _layer_list(plan)
    layers = getattr(lm, lst, None) if lst else None
    if layers is None or not any(k.startswith(f"{lst}.*.") for k in plan):
        return None, ("its base_model_tp_plan shards nothing in the decoder layers: there are no "
                      "tensor-parallel regions to shard the sequence between")
    per_layer = []
    experts = {n for n, _ in lm.named_modules() if any(fnmatch.fnmatchcase(n, p) for p in experts)}
    regions = {k[len(lst) + 3:].split(".")[0] for k in plan if k.startswith(f"{lst}.*.")}
    if any(k[len(lst) + 3:].count(".") == 0 for k in plan if k.startswith(f"{lst}.*.")):
        return None, "its base_model_tp_plan styles a module directly in the decoder layer"
    for i, layer in enumerate(layers):
        norms, regs = [], []
        for name, child in layer.named_children():
            sparse = any(n.startswith(f"{lst}.{i}.{name}.") for n in experts)
            kind, entries = (_region(layer, i, lst, name, plan, experts)
                             if name in regions or sparse else ("norm", ()))
            if kind == "refused":
                return None, entries
            if kind != "norm":
                regs.append((name, kind, entries))
            elif not _is_norm(child, hidden):
                return None, (f"decoder layer {i}'s {name} ({type(child).__name__}) lies outside the "
                              "plan's tensor-parallel regions and is not a per-token norm (it may "
                              "mix tokens; its parameters are not one [hidden] vector each)")
            elif any(True for _ in child.parameters()):
                norms.append(name)
        if not regs:
            return None, f"decoder layer {i} has no tensor-parallel region in the plan"
        per_layer.append((tuple(norms), tuple(regs)))
    tail = []
    for name, child in lm.named_children():
        if name in (lst, "embed_tokens") or not any(True for _ in child.parameters()):
            continue
        if not _is_norm(child, hidden):
            return None, (f"its language model's {name} ({type(child).__name__}) is neither the "
                          "embedding, the decoder layers nor a per-token norm")
        tail.append(name)
    return (lst, tuple(per_layer), tuple(tail)), ""


def hf_sp_plan(layout: tuple, prefix: str, text_config, head: str = "lm_head") -> dict:
    """The text-SP plan of a `sp_layout` (module docstring); keys as `hf_text_plan`'s."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    from ray_dhp.models.text_plans import hf_style
    from ray_dhp.parallel.seq_gather import (AfterLayers, GatheredColwise, GatheredRegion,
                                             LayersDone, ShardSequence)

    lst, per_layer, tail = layout
    marker = LayersDone()
    out = {f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Replicate()),
           f"{prefix}.{lst}.0": ShardSequence(input_kwarg="hidden_states", marker=marker)}
    same = all(x == per_layer[0] for x in per_layer)
    for i, (norms, regions) in enumerate(per_layer[:1] if same else per_layer):
        at = f"{prefix}.{lst}.{'*' if same else i}"
        for n in norms:
            out[f"{at}.{n}"] = _local_norm()
        for name, kind, entries in regions:
            if kind == "megatron":
                out[f"{at}.{name}"] = GatheredColwise(tuple(r for r, s in entries if s == "colwise"),
                                                      input_kwarg="hidden_states")
            else:
                out[f"{at}.{name}"] = GatheredRegion(input_kwarg="hidden_states",
                                                     shard_output=kind == "sparse")
            for rest, style in entries:
                if kind != "sparse" and style in _ROW:
                    out[f"{at}.{name}.{rest}"] = RowwiseParallel(
                        input_layouts=Replicate() if style == "rowwise_split_input" else Shard(-1),
                        output_layouts=Shard(1))
                elif kind != "megatron":
                    out[f"{at}.{name}.{rest}"] = hf_style(style, text_config)
    for n in tail:
        out[f"{prefix}.{n}"] = AfterLayers(marker)
    out[head] = GatheredColwise(("",), output_placement=Shard(-1))
    return out


def _local_norm():
    from torch.distributed.tensor.parallel import SequenceParallel

    return SequenceParallel(use_local_output=True)
