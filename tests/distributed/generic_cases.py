"""The generic families' parity tolerances and the parameters left out of their comparisons,
shared by `family_rows.py` (their rows of the fp64 matrix, `test_families.py`), `test_generic.py`,
`test_generic_moe.py` and `test_packing.py` (the reasons and measurements are below)."""

TOL = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)
# Some language models' norm weights get a gradient that is the small remainder of large
# per-sample terms (Gemma's RMSNorm ``1 + w``, zero at init; Cohere's LayerNorm): summed over the
# samples in another order it differs far above the ulp. Measured (tiny configs, 3 steps,
# worst update / loss / grad-norm error) with pure data parallelism of the text over two ranks,
# where nothing is sharded and only the order of the sum changes:
#   gemma3 2.5e-7 / 1.4e-9 / 1.1e-8 (text TP2, the per-head q/k norms' partial sums: 1.1e-6),
#   aya_vision 4.8e-8 / 1.4e-9 / 2.7e-8, cohere2_vision 6.3e-6 / 1.8e-10 / 1.0e-9;
#   llava (a Llama LM) 6.1e-15 / 1.5e-16 / 0.
# GLM-4V's tower likewise, over the images of two vision replicas (its interpolated position
# table gathers many images' gradients): 1.1e-7 / 1.3e-9 / 1.6e-8 in every layout with vision DP2.
# These rows are held to about ten times that; a wrong split, a missing partial-gradient sum or
# a dropped forward keyword (Gemma 3's ``token_type_ids``) is still O(1e-3) or more.
GEMMA = dict(loss_tol=1e-7, param_tol=1e-5, update_tol=1e-5, grad_tol=1e-5)
COHERE = dict(loss_tol=1e-7, param_tol=1e-4, update_tol=1e-4, grad_tol=1e-4)
GLM = dict(loss_tol=1e-7, param_tol=1e-6, update_tol=1e-6, grad_tol=1e-6)
# GLM-4.5V (``glm4v_moe``): its router computes the logits in fp32 even in an fp64 model
# (``F.linear(x.float(), w.float())``), so the router weight's gradient is an fp32 sum over the
# tokens; split over two text replicas (text DP2, EP2, ZeRO-3) it is summed in another order.
# Measured (3 steps): router gradient 2.5e-7, update 2.0e-7, parameter 1.7e-8, loss 1.5e-10,
# grad-norm 3.8e-9; text TP2 alone (one replica, routers replicated): 1.8e-15. Held to the fp32
# tolerance `tests.distributed.parity.FP32_TOL` derives (1e-5); leaving the router loss out is
# 2.8e-1 on the router's gradient, 3.9e-5 on the loss (test_generic_moe.py's negative control).
GLM_MOE = dict(loss_tol=1e-7, param_tol=1e-5, update_tol=1e-5, grad_tol=1e-5)
# Kimi-K2.5 (a DeepSeek-V3 LM) likewise: its router's logits are fp32 (``F.linear(x.type(
# torch.float32), w.type(torch.float32))``). Measured with text ZeRO-3 DP2 (3 steps): router
# gradient 7.7e-8 at step 1, 1.4e-7 at step 3, update 1.1e-7; the rest it reaches at step 3 up to
# 6.2e-8 (vision biases); text TP2 (routers replicated) within 1e-10.
# ERNIE-4.5-VL (``ernie4_5_vl_moe``) likewise: its router's logits are fp32 (``F.linear(
# hidden_states.float(), self.weight.float())``). Measured with text ZeRO-3 DP2 (3 steps): only the
# router gradient is off at step 1 (1.1e-7), by step 3 the rest it reaches up to 8e-8, the router's
# update 3.6e-7, parameter 3.3e-8, loss 3.3e-10, grad-norm 1.6e-9; text TP2 (routers replicated,
# collocated vision DP2 and disjoint 1 + TP2) within 3.7e-14.
# LFM2-VL's SigLIP 2 NaFlex tower resizes its position table to each image's grid in fp32 even in
# an fp64 model (``weights @ table.float()``, one matmul over the batch's padded positions), so
# the table's gradient is an fp32 sum whose order and blocking follow which images share a
# call: the stock model's own gradient for three images in one call vs split 2 + 1 differs by
# 4.7e-8 (patch embedding: 8.5e-16). With vision DP2 (measured, 3 steps, both layouts with it):
# that gradient 4.6e-8 at step 1, the tower's others it reaches by step 3 up to 1.3e-7, updates
# 1.0e-7, parameters 1.1e-8, grad-norm 5.1e-9, loss 6.4e-11; disjoint 1 + TP2 (one vision rank)
# within 2.2e-15. Held to about ten times that, as GLM-4V's interpolated table. Cosmos3-Edge's
# SigLIP 2 tower (on patch rows + grid) likewise: that table's gradient 2.4e-8 at step 1 with
# vision DP2 (4.6e-8 at step 3), its update 4.9e-8, parameter 4.4e-9; the rest within 1e-10.
LFM2_VL = dict(loss_tol=1e-7, param_tol=1e-6, update_tol=1e-6, grad_tol=1e-6)
# GOT-OCR2's SAM tower (PP-Chart2Table's too): the relative-position tables' gradients are off
# by 1.9e-9 with vision DP2 (the updates stay within 5.2e-14, the loss 1.6e-16): its gradients
# are held to 1e-8. ShieldGemma 2 is a Gemma 3 (its norms as above).
# LLaVA-OneVision-1.5's RICE tower prepends a class token whose rotary angles are a parameter
# (``class_pos_emb``), cast to the fp32 rotary tables (``.to(cos.dtype)``, cos / sin computed in
# fp32) and applied to q and k in fp32 (``apply_rotary_pos_emb_vision``): its gradient is an fp32
# sum over every image's class token, taken in another order when the images are split over two
# vision replicas. Measured with vision DP2 (3 steps): its gradient 5.2e-8 at step 1, 6.9e-8 at
# step 3, update 6.2e-8, parameter 1.0e-10; every other tensor within 1e-10; disjoint 1 + TP2
# (one vision rank) 1.1e-14. Held to the tolerance of LFM2-VL's fp32 position table.
# Llama 4 runs parts of its text model in fp32 even in an fp64 model: its RMSNorms
# (``self._norm(x.float())``), the rotary embedding of q and k (``view_as_complex(xq.float())``)
# and the router's sigmoid; its tower's rotary likewise. A last-bit difference of the fp64 inputs
# (another summation order) then flips an fp32 rounding. Measured (3 steps): collocated DP2 + TP2,
# disjoint 1 + TP2 and text ZeRO-3 DP2 within 1e-10; with Megatron text SP (reduce-scatter in
# place of the all-reduce) steps 1-2 within 1e-10, step 3's gradients 3.7e-8 (experts), updates
# and parameters 3.5e-9, grad-norm 1.2e-10. Held to the tolerance of LFM2-VL's fp32 table.
# MiniCPM-V 4.6's language model is a Qwen3.5 (`family_checks`' Qwen3.5 notes): its zero-centred
# RMSNorms and the Gated DeltaNet's ``A_log`` compute in fp32 even in an fp64 model, so with two
# text replicas (text ZeRO-3 DP2) those weights' gradients are fp32 sums over each replica's
# tokens, added in another order. Measured (3 steps): steps 1-2 only those gradients are off (6.4e-8);
# from step 3 every forward sees norm weights off by ~1e-7 and every gradient follows (1.3e-5,
# the tower's key projection), updates 8.1e-6 (the embedding: AdamW passes a small entry's
# relative error on), parameters 1.0e-6, loss 1.6e-10, grad-norm 9.5e-10. Collocated DP2 + TP2 and
# disjoint 1 + TP2 (one text replica) within 1e-10. Held to 1e-4 (as Cohere's norms). MiniCPM-V
# 4.7 and MiniCPM-OCR (the same LM): the same figures (their step-1 norm gradients up to 8.2e-8).
# Gemma 4's tower pools its patches in fp32 even in an fp64 model (``Gemma4VisionPooler``:
# ``weights @ hidden_states.float()`` over each call's padded patches, then ``* sqrt(hidden)``), so
# its features depend on which images share a call: the stock model's own features for three
# images in one call vs split 2 + 1 differ by 1.6e-8 (of 0.31), its tower's gradients by 4.0e-7
# (the q/k norm weights). With the images split over two vision replicas or SP ranks (measured,
# 2 steps): collocated SP2 + TP2 grads 2.1e-7 at step 1, 1.3e-6 at step 2, updates 6.0e-6,
# parameters 7.2e-8, loss 6.0e-10; text ZeRO-3 DP2 (vision DP2; Gemma's q/k norms' sums over two
# text replicas too) grads 6.8e-7 / 2.8e-6, updates 1.9e-5 (the per-layer embedding table: AdamW
# passes a small entry's relative error on), parameters 8.3e-7, loss 6.0e-10, grad-norm 3.6e-7;
# disjoint 1 + TP2 (one vision rank) only the text q/k norms' partial sums, 2.1e-7. A third step
# amplifies the noise 30x (grads 9.2e-5: the norm weights' gradients are small remainders), so its
# rows run 2 steps (`STEPS`), held to 1e-4 (as Cohere's), the loss and grad-norm to 4e-6 (about
# ten times that grad-norm).
GEMMA4 = dict(loss_tol=4e-6, param_tol=1e-4, update_tol=1e-4, grad_tol=1e-4)
# Mistral Large 4 (an MLA LM with DeepSeek-style routing) keeps two parameters in fp32 inside an
# fp64 model: its router (``mlp.gate``) and a trained rotary parameter (``rotary_emb.alpha``); their
# gradients are fp32 sums over the tokens. The stock model's own gradients over four samples in
# one call vs 2 + 2 differ by 8.1e-7 (``alpha``) and 1.3e-7 (the router), every fp64 weight by
# < 4.2e-16 (measured). With text ZeRO-3 DP2 (3 steps) the attention's per-head softmax scaling
# follows (parameters 6.0e-9, its step-3 gradient 2.3e-7); collocated DP2 + TP2 and disjoint
# 1 + TP2 (one text replica) within 1e-10. Held to the router tolerance of GLM-4.5V.
# MiniMax-M3-VL's Gemma-style RMSNorms compute in fp32 (``self._norm(x.float())``, ``1 + w``):
# measured with text ZeRO-3 DP2 / text SP (3 steps) their gradients 1.5e-7 / 1.4e-7, parameters
# and updates 1.0e-7 / 8.2e-8, nothing else out of 1e-10; held to Gemma 3's tolerance.
# Qwen4-Exp's language model is Qwen3.5-like (zero-centred fp32 RMSNorms, the Gated DeltaNet's
# ``A_log`` in fp32): with text ZeRO-3 DP2 (3 steps) gradients 1.4e-5 by step 3, updates 6.0e-6,
# parameters 5.1e-7, as MiniCPM-V 4.6's (same LM kind); held to 1e-4 as those.
STEPS = {"gemma4": 2}  # runs shorter than `tests.distributed.parity.CFG`'s 3 steps (reason above)
TOLS = {"llama4": LFM2_VL, "minicpmv4_6": COHERE, "minicpmv4_7": COHERE, "minicpm_ocr": COHERE,
        "gemma3": GEMMA, "gemma4": GEMMA4, "paligemma": GEMMA, "shieldgemma2": GEMMA, "aya_vision": COHERE,
        "cohere2_vision": COHERE, "glm4v": GLM, "glm46v": GLM, "glmga": GLM, "glm4v_moe": GLM_MOE,
        "lfm2_vl": LFM2_VL, "cosmos3_edge": LFM2_VL, "kimi_k25": GLM_MOE, "got_ocr2": dict(TOL, grad_tol=1e-8), "pp_chart2table": dict(TOL, grad_tol=1e-8),
        "llava_onevision1_5": LFM2_VL, "ernie4_5_vl_moe": GLM_MOE, "mistral_large4": GLM_MOE,
        "minimax_m3_vl": GEMMA, "qwen4_exp": COHERE}
# A key projection's bias in a tower without rotary positions (CLIP's, SigLIP's) has an exact
# gradient of 0 (it adds ``q . b`` to every logit of a query, which the softmax cancels): both
# runs' gradients are rounding noise, and AdamW turns noise into O(lr) steps of either sign.
# These are left out of the comparisons, and their gradients are checked to be noise (below
# 1e-12 of the step's gradient norm) in both runs.
ZERO_GRAD = ("vision_tower.encoder.layers.0.self_attn.k_proj.bias",
             "vision_tower.encoder.layers.1.self_attn.k_proj.bias",
             "vision_model.encoder.layers.0.self_attn.k_proj.bias",
             "vision_model.encoder.layers.1.self_attn.k_proj.bias",
             "image_tower.encoder.layers.0.self_attn.k_proj.bias",  # VideoLLaVA's CLIP
             "image_tower.encoder.layers.1.self_attn.k_proj.bias",
             "visual.encoder.layers.0.self_attn.k_proj.bias",  # Cosmos3-Edge's SigLIP 2
             "visual.encoder.layers.1.self_attn.k_proj.bias",
             "vision_tower.vit_merger.self_attn.k_proj.bias")  # MiniCPM-V 4.6's window merger
# Towers that rotate q and k (2-D RoPE: PaddleOCR-VL's SigLIP) give a key bias a real gradient (``q
# . R b`` differs per key position): nothing is left out of their comparisons.
ROTARY_KEY_BIAS = ("paddleocr_vl",)


# The generic families whose tower runs Ulysses SP (`ray_dhp.models.vision_generic_sp`): their
# collocated row is vision SP2 + text TP2, the others' vision DP2 + text TP2 (the driver refuses
# SP for them, with the reason: `GenericFamily.vision_sp_refusal`; `test_generic_sp.py` checks
# this list against it).
VISION_SP = ("gemma3", "llava", "paligemma", "aya_vision", "cohere2_vision", "mistral3", "idefics3",
             "smolvlm", "lighton_ocr", "shieldgemma2", "video_llava", "lfm2_vl", "llama4", "gemma4",
             "llava_onevision", "llava_next", "llava_next_video", "mistral_large4")


def qwen3_5_lm_hybrid_config(family: str):
    """The tiny config of a generic family whose language model is a Qwen3.5 (MiniCPM-V 4.6 /
    4.7, MiniCPM-OCR: ``qwen3_5_text``) with a Gated DeltaNet layer, then a gated full-attention
    layer (the released models' mix; the tiny default's two layers are both linear attention,
    which reads no positions): the packing rows, `test_packing.py`."""
    from ray_dhp import demo

    config = demo.tiny_model_config(family)
    config.text_config.layer_types = ["linear_attention", "full_attention"]
    return config


def lfm2_vl_hybrid_config():
    """The tiny LFM2-VL with LFM2's hybrid decoder (transformers' default config has attention
    only: the released models list ``full_attn_idxs``): a short-convolution layer, then an
    attention layer (the packing rows, `test_packing.py`)."""
    from ray_dhp import demo

    config = demo.tiny_model_config("lfm2_vl")
    config.text_config.layer_types = ["conv", "full_attention"]
    return config


#: The generic families that pack (`ray_dhp.models.generic_packing`: every one but MiniCPM-V 4.7,
#: refused with the reason, test_packing.py's last test), each a row of test_packing.py's
#: disjoint pipelined packing test (which checks the family packs).
PACKING_FAMILIES = (
    "gemma3", "llava", "paligemma", "aya_vision", "cohere2_vision", "mistral3", "idefics3",
    "smolvlm", "glm4v", "glm46v", "lighton_ocr", "glmga", "hyperclovax_vision_v2", "got_ocr2",
    "pp_chart2table", "shieldgemma2", "lfm3_vl", "glm_ocr", "video_llava", "glm4v_moe", "lfm2_vl",
    "kimi_k25", "cosmos3_edge", "paddleocr_vl", "llava_onevision1_5", "ernie4_5_vl_moe", "llama4",
    "minicpmv4_6", "minicpm_ocr", "gemma4", "llava_onevision", "llava_next", "llava_next_video",
    "mistral_large4", "minimax_m3_vl", "qwen4_exp", "minicpmv4_7", "exaone4_5")
#: the packing rows' model where not the family's tiny config (LFM2-VL: its hybrid decoder, the
#: released models' layout, whose short convolutions packing runs one row per sample)
PACKING_MODELS = {"lfm2_vl": lfm2_vl_hybrid_config}
#: the packing rows' ``max_tokens`` where not 80: the LLaVA-NeXT kinds' anyres samples reach
#: 101 tokens (80 would skip them as too long, the other samples still 30-75)
PACKING_MAX_TOKENS = {"llava_onevision": 128, "llava_next": 128, "llava_next_video": 128}
