"""`GatheredColwise` (text sequence parallelism's column-parallel projections): on 2 gloo ranks,
fp64, a gate/up pair fed a sequence-sharded input gives the unsharded module's output columns,
input gradient and weight gradients, and saves only the sequence shard of its gathered input for
backward — where DTensor's ``PrepareModuleInput`` + ``ColwiseParallel`` (the negative control)
saves the whole gathered ``[B, S, D]`` input. The model-level exactness is
``test_text_sp.py``; the measured memory is ``benchmarks/text_sp.py``."""

from __future__ import annotations

import torch

from tests.spawn import run_on_ranks

B, S, D, INTER = 2, 6, 4, 6


class _Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(D, INTER)
        self.up = torch.nn.Linear(D, INTER, bias=False)

    def forward(self, x):
        return torch.nn.functional.silu(self.gate(x)) * self.up(x)


def _run(module, x, w_out):
    shapes = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            shapes.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = module(x)
    (out * w_out).sum().backward()
    return out, shapes


def _body(rank, world):
    return {"gathered": _case(rank, world, True), "control": _case(rank, world, False)}


def _case(rank, world, gathered: bool):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, parallelize_module

    from ray_dhp.parallel.seq_gather import GatheredColwise

    torch.manual_seed(0)
    ref = _Pair().double()
    x = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(INTER, dtype=torch.float64)
    ref_out, _ = _run(ref, x, w_out)

    mesh = init_device_mesh("cpu", (world,))
    mod = _Pair().double()
    mod.load_state_dict(ref.state_dict())
    plan = ({"": GatheredColwise(("gate", "up"))} if gathered else
            {"": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                    use_local_output=True),
             "gate": ColwiseParallel(), "up": ColwiseParallel()})
    parallelize_module(mod, mesh, plan)
    s, c = S // world, INTER // world
    rows, cols = slice(rank * s, (rank + 1) * s), slice(rank * c, (rank + 1) * c)
    xs = x.detach()[:, rows].clone().requires_grad_(True)
    out, shapes = _run(mod, xs, w_out[cols])
    return {"out": (out - ref_out[..., cols]).abs().max().item(),
            "x_grad": (xs.grad - x.grad[:, rows]).abs().max().item(),
            "w_grads": max((getattr(mod, n).weight.grad.to_local() - getattr(ref, n).weight.grad[cols]).abs().max().item()
                           for n in ("gate", "up")),
            "b_grad": (mod.gate.bias.grad.to_local() - ref.gate.bias.grad[cols]).abs().max().item(),
            "shapes": shapes}


def test_gathered_colwise_is_exact_and_saves_the_shard():
    out = run_on_ranks(_body, 2)
    for rank, r in enumerate(o["gathered"] for o in out):
        assert max(r["out"], r["x_grad"], r["w_grads"], r["b_grad"]) < 1e-12, (rank, r)
        # numel of what was saved (B*S*D = 48 would be the gathered input, in any view)
        assert B * S * D not in r["shapes"] and B * S // 2 * D in r["shapes"], r["shapes"]
    for r in (o["control"] for o in out):  # the control: DTensor's styles keep the whole input
        assert max(r["out"], r["x_grad"], r["w_grads"]) < 1e-12 and B * S * D in r["shapes"], r
