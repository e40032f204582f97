"""The contenders, built inside one spawned world: same model (same seed), same data, same ranks.

Each contender has ``step(batch) -> loss`` (one optimizer step over the global batch, loss =
token-mean cross-entropy of the step, identical definition everywhere), ``vision`` (the vision
tower module it runs, for activation tagging) and ``state()`` (local parameter / gradient /
optimizer bytes). Gradients are laid out like the parameters in every contender (fp32), so the
gradient bytes equal the parameter bytes.

* ``dhp``: `ray_dhp.step.engine.DHPEngine`, collocated, vision SP = world, text TP = world.
* ``dhp-disjoint``: `DHPEngine`, vision SP = world/2 on the first half, text TP = world/2 on the rest.
* ``tp``: uniform tensor parallelism (DTensor) of both modules; every rank runs the whole batch.
* ``fsdp2``: ``fully_shard`` per block + root; rank r runs sample r (ZeRO-3 equivalent).
* ``zero3``: DeepSpeed ZeRO stage 3 over the whole model; rank r runs sample r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ray_dhp.step.engine import count_targets, shift_labels
from ray_dhp.models import build_model
from ray_dhp.config.train_loop import TrainLoopConfig

from benchmarks import measure

NAMES = ("dhp", "dhp-disjoint", "tp", "fsdp2", "zero3")


def train_config(batch_size: int, autocast_dtype=None) -> TrainLoopConfig:
    return TrainLoopConfig(lr=1e-4, global_batch_size=batch_size, num_steps=10_000, max_grad_norm=1.0,
                           precision="bf16_autocast" if autocast_dtype == "bfloat16" else "fp32")


def _autocast(cfg, device):
    import contextlib

    from ray_dhp.step.precision import policy_of

    dtype = policy_of(cfg.precision).autocast_dtype
    return contextlib.nullcontext() if dtype is None else torch.autocast(device.type, dtype=dtype)


def _kwargs(samples, device):
    from ray_dhp.data.collate import pad_text_batch

    b = pad_text_batch(samples, 0)
    kw = {k: v.to(device) for k, v in b.items() if v is not None and k != "labels"}
    return kw, shift_labels(b["labels"]).to(device)


def _ce_sum(logits, targets):
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100, reduction="sum")


class DHP:
    def __init__(self, config, cfg, device, *, sp, tp, placement="collocated", comm=None, text_sp=False):
        from ray_dhp.step.engine import DHPEngine
        from ray_dhp.parallel.mesh import build_groups
        from ray_dhp.parallel.topology import Topology

        world = dist.get_world_size()
        dp_v = world // sp if placement == "collocated" else 1
        dp_t = world // tp if placement == "collocated" else 1
        topo = Topology.build(placement=placement, vision_dp=dp_v, vision_sp=sp, text_dp=dp_t, text_tp=tp,
                              text_sequence_parallel=text_sp)
        self.engine = DHPEngine(config, build_groups(topo, device), cfg.step_config(), comm=comm)
        self.vision = self.engine.visual

    def step(self, batch) -> float:
        return self.engine.step([batch])["loss"]

    def state(self) -> dict:
        e = self.engine
        p = measure.params_bytes(e.vision_params + e.text_params)
        return {"params": p, "grads": p,
                "optimizer": measure.optimizer_bytes(e.vision_opt) + measure.optimizer_bytes(e.text_opt)}


class UniformTP:
    def __init__(self, config, cfg, device):
        from torch.distributed.device_mesh import init_device_mesh

        from ray_dhp.models.text_plans import standard_text_plan
        from ray_dhp.step.optim import build_optimizer
        from ray_dhp.parallel.tensor import apply_tp_plan

        from benchmarks.baselines.vit_tp import parallelize_vit

        self.cfg, self.device = cfg, device
        self.mesh = init_device_mesh(device.type, (dist.get_world_size(),), mesh_dim_names=("tp",))
        self.model = build_model(config, seed=cfg.optim.seed).to(device)
        self.model.train()
        parallelize_vit(self.model, self.mesh["tp"])
        apply_tp_plan(self.model, self.mesh["tp"], standard_text_plan())
        self.vision = self.model.model.visual
        self.opt, _ = build_optimizer(self.model.named_parameters(), cfg.optim)

    def step(self, batch) -> float:
        from torch.distributed.tensor.parallel import loss_parallel

        from ray_dhp.parallel import data_parallel as dp

        n = count_targets(batch)
        kw, targets = _kwargs(batch, self.device)
        with _autocast(self.cfg, self.device):
            out = self.model(**kw, use_cache=False)
        with loss_parallel():
            loss = _ce_sum(out.logits, targets)
            (loss / n).backward()
        params = dp.ensure_grads(list(self.model.parameters()))
        norm = float(dp.squared_norm(params, self.mesh.get_group("tp")).sqrt())
        dp.scale_grads(params, dp.clip_coefficient(norm, self.cfg.optim.max_grad_norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach().full_tensor()) / n

    def state(self) -> dict:
        p = measure.params_bytes(self.model.parameters())
        return {"params": p, "grads": p, "optimizer": measure.optimizer_bytes(self.opt)}


class _DataParallel:
    """Shared by FSDP2 and ZeRO-3: rank r runs sample r; loss scaled so that the averaging
    gradient reduction gives the single-process gradient of the global token-mean loss."""

    def _local(self, batch):
        r, w = dist.get_rank(), dist.get_world_size()
        if len(batch) % w:
            raise ValueError(f"global batch {len(batch)} must be a multiple of the world size {w}")
        per = len(batch) // w
        return batch[r * per:(r + 1) * per], count_targets(batch), w

    @staticmethod
    def _global_loss(local_sum: torch.Tensor, n: int) -> float:
        t = local_sum.detach().double().reshape(1)
        dist.all_reduce(t)
        return float(t) / n


class FSDP2(_DataParallel):
    def __init__(self, config, cfg, device):
        from torch.distributed.fsdp import fully_shard

        self.cfg, self.device = cfg, device
        self.model = build_model(config, seed=cfg.optim.seed).to(device)
        self.model.train()
        for blk in self.model.model.visual.blocks:
            fully_shard(blk)
        for layer in self.model.model.language_model.layers:
            fully_shard(layer)
        fully_shard(self.model)
        self.vision = self.model.model.visual
        from ray_dhp.step.optim import build_optimizer

        self.opt, _ = build_optimizer(self.model.named_parameters(), cfg.optim)

    def step(self, batch) -> float:
        local, n, w = self._local(batch)
        kw, targets = _kwargs(local, self.device)
        with _autocast(self.cfg, self.device):
            logits = self.model(**kw, use_cache=False).logits
        loss = _ce_sum(logits, targets)
        (loss * w / n).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.max_grad_norm)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return self._global_loss(loss, n)

    def state(self) -> dict:
        p = measure.params_bytes(self.model.parameters())
        return {"params": p, "grads": p, "optimizer": measure.optimizer_bytes(self.opt)}


def deepspeed_config(cfg, world: int, bf16: bool = False) -> dict:
    return {
        "train_batch_size": cfg.optim.global_batch_size, "train_micro_batch_size_per_gpu": cfg.optim.global_batch_size // world,
        "gradient_accumulation_steps": 1, "gradient_clipping": cfg.optim.max_grad_norm,
        # Gather one block at a time, release right after use, no prefetch: the ZeRO-3 regime of a
        # model far larger than these (DeepSpeed's defaults keep 1e9 parameters live, i.e. the
        # whole benchmark model, which would make it plain data parallelism).
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_max_live_parameters": 1_000_000, "stage3_max_reuse_distance": 0,
                              "stage3_prefetch_bucket_size": 0, "overlap_comm": False,
                              "contiguous_gradients": True},
        "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
        "bf16": {"enabled": bf16}, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
    }


class Zero3(_DataParallel):
    def __init__(self, config, cfg, device):
        import deepspeed

        from ray_dhp.step.optim import param_groups

        self.cfg, self.device = cfg, device
        deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
        model = build_model(config, seed=cfg.optim.seed).to(device)
        model.train()
        opt = torch.optim.AdamW(param_groups(model.named_parameters(), cfg.optim.weight_decay), lr=cfg.optim.lr,
                                betas=cfg.optim.betas, eps=cfg.optim.eps, foreach=False)
        self.engine, self.opt, _, _ = deepspeed.initialize(
            model=model, optimizer=opt, config=deepspeed_config(cfg, dist.get_world_size()))
        self.vision = self.engine.module.model.visual

    def step(self, batch) -> float:
        local, n, w = self._local(batch)
        kw, targets = _kwargs(local, self.device)
        with _autocast(self.cfg, self.device):
            logits = self.engine(**kw, use_cache=False).logits
        loss = _ce_sum(logits, targets)
        self.engine.backward(loss * w / n)
        self.engine.step()
        return self._global_loss(loss, n)

    def state(self) -> dict:
        inner = getattr(self.opt, "optimizer", self.opt)
        flat = getattr(self.opt, "fp32_partitioned_groups_flat", [])
        p = measure.params_bytes(self.engine.module.parameters())
        return {"params": p, "grads": p,
                "optimizer": measure.optimizer_bytes(inner) + measure.tensor_bytes(flat)}


def build(name: str, config, cfg, device, comm=None):
    """Build contender ``name``; ``cfg.precision.policy="bf16_autocast"`` runs every forward under bf16 autocast."""
    world = dist.get_world_size()
    if name == "dhp":
        return DHP(config, cfg, device, sp=world, tp=world, comm=comm)
    if name == "dhp-disjoint":
        return DHP(config, cfg, device, sp=world // 2, tp=world // 2, placement="disjoint", comm=comm)
    if name == "tp":
        return UniformTP(config, cfg, device)
    if name == "fsdp2":
        return FSDP2(config, cfg, device)
    if name == "zero3":
        return Zero3(config, cfg, device)
    raise ValueError(f"unknown contender {name!r}; choose from {NAMES}")
