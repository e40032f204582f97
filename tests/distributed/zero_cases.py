"""The ZeRO parity case `test_zero.py` and `test_offload.py` share: configuration, family, layout
and the fp64 tolerance (1e-10 relative on the loss, every parameter, update and gradient: only
summation orders differ from the single-process reference)."""

from ray_dhp.config.train_loop import TrainLoopConfig

CFG = TrainLoopConfig(lr=1e-3, global_batch_size=8, micro_batches=2, num_steps=2,
                      max_grad_norm=0.5, weight_decay=0.1, lr_schedule="cosine", warmup_steps=1)
FAMILY = "qwen2_5_vl"
TOL = dict(loss_tol=1e-10, param_tol=1e-10, update_tol=1e-10, grad_tol=1e-10)

COLLOCATED = dict(placement="collocated", vision_dp=2, vision_sp=2, text_dp=2, text_tp=2)
