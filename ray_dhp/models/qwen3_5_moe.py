"""Qwen3.5-MoE: Qwen3.5's ViT and hybrid LM (Gated DeltaNet and gated full-attention layers, the
plans of `ray_dhp.models.qwen3_5`) with a sparse block in EVERY decoder layer (transformers'
``Qwen3_5MoeDecoderLayer`` always builds one: no ``decoder_sparse_step`` / ``mlp_only_layers``,
no dense MLP).

The sparse block differs from Qwen3-VL-MoE's by a shared expert: its output is

    experts(x; router top-k) + sigmoid(shared_expert_gate(x)) * shared_expert(x)

The router (``mlp.gate``: softmax, top-k, the top-k weights renormalised) and the fused experts
(``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``, the same forward) have
exactly Qwen3-VL-MoE's layout, so the mixture-of-experts machinery applies unchanged: the
router's load-balancing loss (`ray_dhp.models.moe`, transformers' ``load_balancing_loss_func``
over the routers' logits, the shared expert takes no part) and expert parallelism
(`ray_dhp.parallel.expert`: the experts partitioned over text data-parallel ranks).

Under text tensor parallelism:

* the router and the routed experts are replicated on every TP rank (as in Qwen3-VL-MoE: their
  input is the replicated residual stream, so every TP rank computes the whole routed part on
  the same tokens; outputs and gradients equal on every TP rank, no reduction);
* the shared expert is a dense SwiGLU MLP and is TP-sharded like one (``gate_proj``/``up_proj``
  column-parallel, ``down_proj`` row-parallel: one all-reduce, its output replicated);
* ``shared_expert_gate`` (``Linear(H, 1)``) is replicated: its input and the gradient of its
  output (times the replicated shared-expert output) are the same on every TP rank, so its
  gradient is whole there (no partial sum), like the router's.

The TP degree must divide the shared expert's width (``shared_expert_intermediate_size``) and
the linear-attention heads. Packing works as for Qwen3.5 (its Gated DeltaNet layers run one row
per packed sample); routing is per token, and the load-balancing loss counts the real tokens of
the packed rows (padding excluded, as the reference's attention mask does), so packed and
padded micro-batches give the same statistics.

Under text sequence parallelism (`text_sp_plan`) the attention and linear-attention layers are
Qwen3.5's; the sparse block's input is all-gathered along the sequence (DTensor
``PrepareModuleInput``: ``Shard(1) -> Replicate``), so the whole block — router, routed experts,
shared expert (plain column/row-parallel, all-reduced output), its gate — runs on the whole
sequence exactly as without SP (the routers' statistics are the full micro-batch's; every
gradient whole on every TP rank, the shared expert's input gradient all-reduced by its
column-parallel style), and its replicated output is cut back to the rank's sequence shard
(``PrepareModuleOutput``: ``Replicate -> Shard(1)``, a local slice; backward: the all-gather of
the shards' gradients). The block keeps the gathered ``S`` tokens, not ``S / tp``: the
sequence-shard economy holds for the attention halves and the norms only.
"""

from ray_dhp.models import qwen3_5
from ray_dhp.models.base import FamilySpec, MoESpec

_MLP = ("gate_proj", "up_proj", "down_proj")


def sparse_layers(text_config) -> list:
    """Every decoder layer has a sparse block (``Qwen3_5MoeDecoderLayer``)."""
    return list(range(text_config.num_hidden_layers))


def text_tp_plan(text_config, prefix: str = "model.language_model") -> dict:
    """`qwen3_5.text_tp_plan` (both mixers sharded by heads, embedding and head vocab-parallel)
    with the dense MLP's entries moved onto the shared expert (``mlp.shared_expert.*``); the
    router, the routed experts and ``shared_expert_gate`` stay replicated (module docstring)."""
    plan = qwen3_5.text_tp_plan(text_config, prefix)
    mlp = f"{prefix}.layers.*.mlp"
    for name in _MLP:
        plan[f"{mlp}.shared_expert.{name}"] = plan.pop(f"{mlp}.{name}")
    return plan


def text_sp_plan(text_config, prefix: str = "model.language_model") -> dict:
    """`qwen3_5.text_sp_plan` with the MLP entries replaced by the gathered sparse block
    (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   PrepareModuleOutput, RowwiseParallel)

    from ray_dhp.parallel.channels import Styles

    plan = qwen3_5.text_sp_plan(text_config, prefix)
    mlp = f"{prefix}.layers.*.mlp"
    for name in (mlp, f"{mlp}.down_proj"):
        plan.pop(name)
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                use_local_output=True)
    shard = PrepareModuleOutput(output_layouts=(Replicate(),), desired_output_layouts=(Shard(1),),
                                use_local_output=True)
    plan[mlp] = Styles(gather, shard)
    plan.update({f"{mlp}.shared_expert.gate_proj": ColwiseParallel(),
                 f"{mlp}.shared_expert.up_proj": ColwiseParallel(),
                 f"{mlp}.shared_expert.down_proj": RowwiseParallel()})
    return plan


def text_tp_divisors(text_config) -> tuple:
    return (*qwen3_5.text_tp_divisors(text_config),
            ("shared expert intermediate size", text_config.shared_expert_intermediate_size))


SPEC = FamilySpec(
    name="qwen3_5_moe",
    model_type="qwen3_5_moe",
    model_class="Qwen3_5MoeForConditionalGeneration",
    text_tp_plan=text_tp_plan,
    text_sp_plan=text_sp_plan,
    tp_partial_grad_suffixes=qwen3_5.SPEC.tp_partial_grad_suffixes,
    tp_divisors=text_tp_divisors,
    stateful_mixers=qwen3_5.STATEFUL_MIXERS,
    text_mixer_layers=qwen3_5.linear_attention_layers,
    text_mixer_saved=qwen3_5.linear_attention_saved,
    moe=MoESpec(router_suffix="mlp.gate", experts_suffix="mlp.experts", sparse_layers=sparse_layers),
)
