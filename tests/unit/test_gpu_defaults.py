"""The GPU defaults' decisions (`ray_dhp.step.gpu`, `ray_dhp.step.optim.adamw_impl`,
`PhaseTimer`), exercised on CPU with a CUDA ``torch.device`` (constructing one needs no GPU)."""

from __future__ import annotations

import torch

from ray_dhp.step import gpu
from ray_dhp.step.microbatch import PhaseTimer
from ray_dhp.step.optim import adamw_impl
from ray_dhp.config.train_loop import TrainLoopConfig

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_tf32_is_on_by_default_for_cuda_only():
    assert TrainLoopConfig().precision.tf32 is True
    assert gpu.tf32_flags(True, CUDA) == {"matmul.allow_tf32": True, "cudnn.allow_tf32": True}
    assert gpu.tf32_flags(False, CUDA) == {"matmul.allow_tf32": False, "cudnn.allow_tf32": False}
    before = torch.backends.cuda.matmul.allow_tf32
    assert gpu.apply_tf32(True, CPU) is None  # CPU matmuls keep full fp32 precision
    assert torch.backends.cuda.matmul.allow_tf32 == before


def test_phase_timer_synchronises_cuda_at_both_edges(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append(device))
    timer = PhaseTimer(CUDA)
    with timer("text_fwd_bwd"):
        assert calls == [CUDA]  # queued work of the previous phase is not billed to this one
    assert calls == [CUDA, CUDA] and timer.totals["text_fwd_bwd"] >= 0
    with PhaseTimer(CPU)("vision_fwd"):
        pass
    assert len(calls) == 2


def test_host_to_cuda_copies_are_pinned_and_non_blocking(monkeypatch):
    seen = {}

    class Host(torch.Tensor):
        def pin_memory(self):
            seen["pinned"] = True
            return self

        def to(self, *args, **kwargs):
            seen["to"] = (args, kwargs)
            return "on-device"

    t = torch.zeros(3).as_subclass(Host)
    assert gpu.to_device(t, CUDA) == "on-device"
    assert seen == {"pinned": True, "to": ((CUDA,), {"non_blocking": True})}
    assert gpu.to_device(torch.zeros(2), CPU).device == CPU


def test_adamw_is_fused_on_cuda_foreach_for_dtensors_single_tensor_on_cpu(monkeypatch):
    import torch.distributed.tensor as dtensor

    class FakeCuda:
        device = CUDA

    class FakeCudaDTensor(FakeCuda):
        pass

    assert adamw_impl([torch.zeros(1)]) == {"foreach": False}
    assert adamw_impl([FakeCuda()]) == {"fused": True}
    monkeypatch.setattr(dtensor, "DTensor", FakeCudaDTensor)  # fused refuses DTensor params
    assert adamw_impl([FakeCuda(), FakeCudaDTensor()]) == {"foreach": True}
