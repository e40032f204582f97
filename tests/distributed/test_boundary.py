"""The module boundary's sends do not block: a vision rank posts its features and goes on before
the text rank asks for them (what lets the pipelined schedule overlap the two groups). Once the
pair's first exchange has created its communicator: NCCL creates it at the pair's first
operation, both ranks together (the NCCL twin, tests/nccl_twin.py, blocks there as NCCL does)."""

import os
import time

import torch

from tests.spawn import run_on_ranks


def _body(rank, world, flag):
    from ray_dhp.parallel import boundary as bnd
    from ray_dhp.parallel.topology import Topology

    topo = Topology.build(placement="disjoint", vision_dp=1, vision_sp=1, text_dp=1, text_tp=1)
    held = {0: torch.arange(6)}          # the vision rank computed rows 0..5
    needed = {1: range(0, 6)}            # the text rank consumes them all
    plan = bnd.plan_boundary(topo, rank, held, needed)
    inflight = bnd.InFlight()
    feats = torch.arange(6 * 4, dtype=torch.float64).view(6, 4)
    cpu = torch.device("cpu")
    warm = bnd.features_forward(plan, feats if rank == 0 else None, 4, torch.float64, cpu)
    bnd.features_backward(plan, warm if rank == 1 else None, 6 if rank == 0 else 0, 4,
                          torch.float64, cpu)  # the pair's communicator exists from here on
    if rank == 0:
        out = bnd.features_forward(plan, feats, 4, torch.float64, torch.device("cpu"), inflight=inflight)
        assert out.shape == (0, 4)
        open(flag, "w").close()          # the send is posted and the call has returned
        grads = bnd.features_backward(plan, None, 6, 4, torch.float64, torch.device("cpu"),
                                      inflight=inflight)
        inflight.wait()
        return grads
    deadline = time.monotonic() + 120
    while not os.path.exists(flag):      # receive only after the sender has moved on: a blocking
        if time.monotonic() > deadline:  # send would never get here
            raise AssertionError("the vision rank's features_forward did not return before "
                                 "the text rank received")
        time.sleep(0.01)
    got = bnd.features_forward(plan, None, 4, torch.float64, torch.device("cpu"), inflight=inflight)
    assert torch.equal(got, feats)
    bnd.features_backward(plan, 2 * got, 0, 4, torch.float64, torch.device("cpu"), inflight=inflight)
    inflight.wait()
    return got


def test_features_are_sent_without_waiting_for_the_receiver(tmp_path):
    out = run_on_ranks(_body, 2, (str(tmp_path / "sent"),))
    feats = torch.arange(24, dtype=torch.float64).view(6, 4)
    assert torch.equal(out[1], feats)
    assert torch.equal(out[0], 2 * feats)  # the adjoint: every vision row gets its gradient once
