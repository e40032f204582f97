"""Qwen3-VL-MoE: Qwen3-VL's ViT (deepstack, learned position table) and a mixture-of-experts
Qwen3 LM (per-head q/k norms; sparse MLP blocks of fused experts and a top-k softmax router).

Under text tensor parallelism the attention is sharded as in Qwen3-VL (the same q/k-norm partial
gradients); a sparse block (router ``mlp.gate`` and experts ``mlp.experts``) is replicated on
every TP rank like a norm: its input is the replicated residual stream, every TP rank computes
the whole block on the same tokens, so its output and its gradients are the same on every TP
rank (no reduction). Dense layers (``mlp_only_layers``, ``decoder_sparse_step``) get the dense
MLP plan. Text sequence parallelism is not covered for this family (the driver refuses it).
Experts can instead be partitioned over text data-parallel ranks (`ray_dhp.parallel.expert`) or
sharded over the TP ranks by their intermediate dim (`ray_dhp.parallel.expert_tp`).
"""

from ray_dhp.models.base import FamilySpec, MoESpec
from ray_dhp.models.text_plans import standard_text_plan

_DENSE_MLP = (".mlp.gate_proj", ".mlp.up_proj", ".mlp.down_proj")


def sparse_layers(text_config) -> list:
    """Indices of the decoder layers with a sparse (mixture-of-experts) MLP, as transformers
    builds them (``Qwen3VLMoeTextDecoderLayer``)."""
    tc = text_config
    return [i for i in range(tc.num_hidden_layers)
            if i not in (tc.mlp_only_layers or []) and tc.num_experts > 0
            and (i + 1) % tc.decoder_sparse_step == 0]


def text_tp_plan(text_config, prefix: str = "model.language_model") -> dict:
    """`standard_text_plan` with the dense-MLP entries kept for the dense layers only."""
    plan = standard_text_plan(prefix)
    mlp = {k: v for k, v in plan.items() if k.endswith(_DENSE_MLP)}
    plan = {k: v for k, v in plan.items() if k not in mlp}
    sparse = set(sparse_layers(text_config))
    for i in range(text_config.num_hidden_layers):
        if i not in sparse:
            plan.update({k.replace(".layers.*.", f".layers.{i}."): v for k, v in mlp.items()})
    return plan


SPEC = FamilySpec(
    name="qwen3_vl_moe",
    model_type="qwen3_vl_moe",
    model_class="Qwen3VLMoeForConditionalGeneration",
    text_tp_plan=text_tp_plan,
    text_sp_plan=None,
    tp_partial_grad_suffixes=("self_attn.q_norm.weight", "self_attn.k_norm.weight"),
    num_deepstack=lambda config: len(config.vision_config.deepstack_visual_indexes),
    moe=MoESpec(router_suffix="mlp.gate", experts_suffix="mlp.experts", sparse_layers=sparse_layers),
)
