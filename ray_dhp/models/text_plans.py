"""The Megatron-style tensor-parallel plans of the Qwen2/Qwen2.5/Qwen3 language models (and the
language models that share their module names, InternVL's): plain, and with Megatron sequence
parallelism. A family file picks one (`FamilySpec.text_tp_plan` / ``text_sp_plan``). And
`hf_text_plan`: a language model's own ``base_model_tp_plan`` (transformers' styles) as such a
plan (the generic family's, `ray_dhp.models.generic`)."""

from __future__ import annotations

import torch
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

__all__ = ["standard_text_plan", "sequence_parallel_text_plan", "hf_text_plan", "hf_style",
           "HF_STYLES", "TailGradAllReduce"]


def standard_text_plan(prefix: str = "model.language_model") -> dict:
    """Megatron-style plan shared by the Qwen2/Qwen2.5/Qwen3 language models.

    Attention q/k/v and MLP gate/up are column-parallel, o/down row-parallel (one all-reduce per
    block half), the embedding is vocab-parallel, and ``lm_head`` is column-parallel with its
    logits left sharded over the vocabulary for ``loss_parallel`` (no full-logit gather).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    layer = f"{prefix}.layers.*"
    return {
        f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{layer}.self_attn.q_proj": ColwiseParallel(),
        f"{layer}.self_attn.k_proj": ColwiseParallel(),
        f"{layer}.self_attn.v_proj": ColwiseParallel(),
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel(),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }


def sequence_parallel_text_plan(prefix: str = "model.language_model") -> dict:
    """`standard_text_plan` plus Megatron sequence parallelism (Korthikanti et al. 2022): the plan
    shape of torchtitan's Llama, with Megatron-LM's saved-activation economy.

    Between the tensor-parallel regions the hidden states are sharded along the sequence over
    the TP ranks: the norms run on the local tokens (DTensor ``SequenceParallel``), the attention
    and MLP inputs are all-gathered along the sequence before the column-parallel projections,
    and the row-parallel ``o_proj`` / ``down_proj`` reduce-scatter into the sequence shard
    (``RowwiseParallel(output_layouts=Shard(1))``) instead of all-reducing. The column-parallel
    projections (q/k/v, gate/up, ``lm_head``) are `GatheredColwise`: one all-gather per module,
    and each linear saves only the sequence shard for its weight gradient, re-gathering it in
    backward (DTensor's ``ColwiseParallel`` would save the gathered input, ``S`` tokens per rank).
    The residual stream, every saved activation of a block and every checkpointed block input
    is ``S / tp`` tokens per rank.

    Sharding begins at the input of the first decoder layer (`ShardSequence`: a local slice,
    copied so the whole embedding output is not kept; no communication): the Qwen-VL model
    places the image features into the embeddings, builds the attention mask and the M-RoPE
    cos/sin from the *full* sequence before the layers, and every layer then gets the full mask
    and cos/sin as keyword arguments; they meet the hidden states only inside attention, after
    the all-gather, so they stay whole and consistent. The final norm runs on the shard and
    ``lm_head`` all-gathers the sequence (vocab-sharded ``Shard(-1)`` logits for
    ``loss_parallel`` as before). The sequence length must be a multiple of tp (the engine
    pads). Qwen3-VL's deepstack additions between layers act on the shard: see
    ``ray_dhp.parallel.text_sp.install_deepstack_shard``.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel

    from ray_dhp.parallel.seq_gather import GatheredColwise, ShardSequence

    layer = f"{prefix}.layers.*"
    return {
        f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        f"{prefix}.layers.0": ShardSequence(),
        f"{layer}.input_layernorm": SequenceParallel(),
        f"{layer}.self_attn": GatheredColwise(("q_proj", "k_proj", "v_proj"), input_kwarg="hidden_states"),
        f"{layer}.self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{layer}.post_attention_layernorm": SequenceParallel(),
        f"{layer}.mlp": GatheredColwise(("gate_proj", "up_proj")),
        f"{layer}.mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
        f"{prefix}.norm": SequenceParallel(use_local_output=True),
        "lm_head": GatheredColwise(("",), output_placement=Shard(-1)),
    }


#: the ``base_model_tp_plan`` styles `hf_text_plan` translates
HF_STYLES = ("colwise", "rowwise", "colwise_gather_output", "rowwise_split_input",
             "replicated_with_grad_allreduce", "embedding_rowwise", "mla_kv_a_proj")


def hf_text_plan(plan: dict, prefix: str, text_config=None, head: str = "lm_head") -> dict:
    """``base_model_tp_plan`` (keys relative to the language model) -> ``{full path: style}``,
    with the vocabulary-parallel embedding and ``lm_head`` (logits sharded over the vocabulary).
    ``mla_kv_a_proj`` (an MLA's joint KV projection, kept whole: `TailGradAllReduce` over its
    last ``qk_rope_head_dim`` outputs) reads ``text_config``; ``head``: the output head's path.
    With Megatron sequence parallelism: `ray_dhp.models.text_sp_plans.hf_sp_plan`."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {f"{prefix}.embed_tokens": RowwiseParallel(input_layouts=Replicate(),
                                                     output_layouts=Replicate())}
    for key, style in plan.items():
        got = hf_style(style, text_config)
        if got is not None:
            out[f"{prefix}.{key}"] = got
    out[head] = ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
    return out


def hf_style(style: str, text_config=None):
    """One ``base_model_tp_plan`` style as a DTensor style (None: ``replicated_with_grad_allreduce``,
    whose gradients the engine sums, `FamilySpec.tp_partial_grad_suffixes`)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if style == "colwise":
        return ColwiseParallel()
    if style == "rowwise":
        return OwnedRowwise()
    if style == "colwise_gather_output":  # a fused gate_up the forward chunks whole
        return ColwiseParallel(output_layouts=Replicate())
    if style == "rowwise_split_input":    # ... so the next linear takes its slice
        return RowwiseParallel(input_layouts=Replicate())
    if style == "embedding_rowwise":      # a vocabulary-parallel embedding
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
    if style == "mla_kv_a_proj":
        return TailGradAllReduce(text_config.qk_rope_head_dim)
    return None


class OwnedRowwise(RowwiseParallel):
    """``RowwiseParallel`` whose replicated output is a tensor of its own, not DTensor's
    ``to_local`` view: a forward that adds into a linear's output in place (Llama 4's shared
    expert: ``out.add_(routed)``) is refused by autograd on such a view. One copy of the output,
    freed with it; the values are the same."""

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        out = RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs,
                                                 device_mesh)
        return out.clone() if use_local_output else out


class TailGradAllReduce(ParallelStyle):
    """A replicated linear whose last ``tail`` outputs feed only the local heads (an MLA's rotary
    key part, which bypasses the column-parallel ``kv_b_proj``): their gradient is partial on
    each TP rank, so it is all-reduced (identity forward), as transformers' ``mla_kv_a_proj``
    does. The other outputs reach the column-parallel projection, whose input gradient DTensor
    already sums."""

    shards_parameters = False  # the weight stays whole (`ray_dhp.planning.memory`)

    def __init__(self, tail: int):
        super().__init__()
        self.tail = tail

    def _apply(self, module, device_mesh):
        from torch.distributed.tensor import DTensor, Partial, Replicate

        def hook(_m, _a, out):
            head, tail = out.split([out.shape[-1] - self.tail, self.tail], dim=-1)
            tail = DTensor.from_local(tail, device_mesh, [Replicate()], run_check=False)
            return torch.cat([head, tail.to_local(grad_placements=[Partial()])], dim=-1)
        module.register_forward_hook(hook)
        return module
