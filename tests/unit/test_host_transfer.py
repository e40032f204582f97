"""The host buffers of optimizer offload (`ray_dhp.step.offload.HostTransfer`): pinned only for
a CUDA device (CPU torch cannot pin), and on a CPU device the same copy path gives exactly the
on-device arithmetic (the upcast gradient times the clip coefficient, the weights rounded from
the masters). The pinned, ``non_blocking`` CUDA path needs a GPU and is not exercised here."""

import torch

from ray_dhp.step.offload import HOST, HostTransfer, pins
from ray_dhp.step.precision import MasterWeights


def test_only_a_cuda_device_pins():
    assert pins(torch.device("cpu")) is False
    assert pins(torch.device("cuda")) is torch.cuda.is_available()
    assert HostTransfer(torch.device("cpu")).pinned is False


def _params(dtype):
    g = torch.Generator().manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in ((7, 5), (3,), (11,))]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g).to(dtype)
    return ps


def test_bf16_gradients_are_upcast_into_one_staging_buffer():
    ps = _params(torch.bfloat16)
    want = [p.grad.float() * 0.25 for p in ps]
    t = HostTransfer(torch.device("cpu"))
    chunk = [(p, t.master(p, torch.float32)) for p in ps]
    assert all(m.dtype == torch.float32 and not m.is_pinned() for _, m in chunk)
    t.grads_in(chunk, 0.25)
    assert all(p.grad is None for p in ps)
    for (_, m), w in zip(chunk, want):
        assert m.grad.dtype == torch.float32 and torch.equal(m.grad, w)
    bases = {m.grad.untyped_storage().data_ptr() for _, m in chunk}
    assert len(bases) == 1  # views of one staging buffer
    with torch.no_grad():  # as in MasterWeights.step
        for _, m in chunk:
            m.add_(1.0)
        t.weights_out(chunk)
    for p, m in chunk:
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))


def test_a_host_gradient_in_the_masters_dtype_is_not_copied():
    ps = _params(torch.float32)
    grads = [p.grad for p in ps]
    t = HostTransfer(torch.device("cpu"))
    chunk = [(p, t.master(p, None)) for p in ps]
    t.grads_in(chunk, 1.0)
    assert all(m.grad is g for (_, m), g in zip(chunk, grads))


def test_host_masters_take_the_transfer_path():
    ps = _params(torch.bfloat16)
    named = [(f"w{i}", p) for i, p in enumerate(ps)]
    host = MasterWeights(named, dtype=torch.float32, device=HOST)
    beside = MasterWeights(named, dtype=torch.float32)
    assert isinstance(host.transfer, HostTransfer) and beside.transfer is None
    opt = torch.optim.SGD([m for _, m in host.pairs], lr=0.5)
    want = [(p.detach().float() - 0.5 * 0.5 * p.grad.float()).to(torch.bfloat16) for p in ps]
    host.step(opt, coef=0.5)
    assert all(torch.equal(p.detach(), w) for p, w in zip(ps, want))
    assert all(p.grad is None and m.grad is None for p, m in host.pairs)
