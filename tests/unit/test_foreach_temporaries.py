"""The foreach AdamW's temporaries (issue #42), measured on CPU against `ray_dhp.planning.step_peak`.

On CUDA the engine steps a module with DTensor parameters with ``foreach=True``
(`ray_dhp.step.optim.adamw_impl`); torch's multi-tensor AdamW makes one moment-sized temporary
(``_foreach_sqrt`` of the second moments) for every tensor of the parameter group at once. CPU
runs the same foreach ops (a per-tensor loop below the dispatcher, the same outputs), so the live
bytes a step allocates beyond its state are measured here with a `TorchDispatchMode` that sees
every tensor an op returns whose storage did not exist before (the in-place ops return their
input). What CPU cannot show: CUDA's caching allocator rounding those blocks, and DTensor's
dispatch (its local tensors run the same ops).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ray_dhp.planning.memory_state import RankState
from ray_dhp.planning.step_peak import step_peak
from ray_dhp.step.optim import param_groups
from ray_dhp.step.precision import POLICIES, MasterWeights


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the tensors ops return on new storage, alive at once, while active."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._ptrs: set = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        known = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs or {}))
                 if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            ptr, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
            if ptr in known or ptr in self._ptrs or not n:
                continue
            self._ptrs.add(ptr)
            self.live += n
            self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._freed, ptr, n)
        return out

    def _freed(self, ptr, n):
        self._ptrs.discard(ptr)
        self.live -= n


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.LayerNorm(256),
                               torch.nn.Linear(256, 512), torch.nn.Linear(512, 32))


def _step_peak_of(params, foreach: int) -> int:
    """The planner's step peak over the state (fp32 policy, no reduction) with ``foreach``."""
    n = sum(p.numel() for p in params)
    st = RankState(params=n, updated=n, weights=4 * n, grads=4 * n, masters=0, optimizer=8 * n,
                   startup_peak=0)
    return step_peak(st, POLICIES["fp32"], max(p.numel() for p in params), foreach=foreach) \
        - st.device_total


def _grads(model):
    for p in model.parameters():
        p.grad = torch.randn_like(p)


def test_foreach_adamw_makes_one_moment_sized_temporary_per_tensor_of_the_group():
    model = _model()
    opt = torch.optim.AdamW(param_groups(model.named_parameters(), 0.1, 1e-3), lr=1e-3,
                            foreach=True)
    _grads(model)
    opt.step()  # the moments are made at the first step: measure the second
    _grads(model)
    with LiveBytes() as live:
        opt.step()
    params = list(model.parameters())
    decayed = sum(p.numel() for p in params if p.ndim >= 2)  # the largest group, stepped at once
    assert live.peak == 4 * decayed
    # the planner counts every updated element (the norms' and biases' group too): an upper
    # bound by exactly those
    planned = _step_peak_of(params, foreach=sum(p.numel() for p in params))
    assert planned - live.peak == 4 * sum(p.numel() for p in params if p.ndim < 2)


def test_the_single_tensor_loop_makes_two_temporaries_of_one_tensor():
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    _grads(model)
    opt.step()
    _grads(model)
    with LiveBytes() as live:
        opt.step()
    params = list(model.parameters())
    sizes = [p.numel() for p in params]
    i = sizes.index(max(sizes))
    # ``sqrt(exp_avg_sq)`` and its quotient for the largest tensor, while the loop's ``denom``
    # of the tensor before it is still bound (freed when rebound): 2 of one tensor + 1 of the
    # previous. The planner's CPU figure (fused_adamw=False) counts the 2 (within 5% on the
    # engine's models, tests/distributed/test_step_peak.py); the GPU plan (fused) none.
    assert live.peak == 4 * (2 * sizes[i] + sizes[i - 1])
    assert _step_peak_of(params, foreach=0) == 0


def test_masters_hand_the_foreach_adamw_one_chunk_at_a_time():
    """`MasterWeights.step` steps chunks of about ``chunk_bytes`` (at least one tensor): the
    foreach temporaries are one chunk's, as `ray_dhp.planning.step_peak.foreach_elements`
    counts them under masters (fp32 weights here, so the masters take the gradients as they are
    and only AdamW allocates)."""
    model = _model()
    masters = MasterWeights(model.named_parameters(), dtype=torch.float32)
    opt = torch.optim.AdamW([p for _, p in masters.named_parameters()], lr=1e-3, foreach=True)
    chunk = 4 * 256 * 512 // 2  # half the largest tensor: every chunk is one tensor or less
    for _ in range(2):
        _grads(model)
        if _ == 1:
            with LiveBytes() as live:
                masters.step(opt, chunk_bytes=chunk)
        else:
            masters.step(opt, chunk_bytes=chunk)
    largest = max(p.numel() for p in model.parameters())
    biggest_chunk = max(sum(m.numel() for _, m in c) for c in masters._chunks(chunk))
    assert live.peak == 4 * biggest_chunk == 4 * max(largest, chunk // 4)


def test_the_plan_counts_foreach_temporaries_where_the_engine_uses_foreach():
    """Which modules step with foreach (DTensor parameters: text TP or EP, ZeRO-3) and how much
    at once (everything the module updates; one chunk under masters). Optimizer offload needs
    plain parameters (`ray_dhp.parallel.topology.check_offload`): never foreach."""
    from ray_dhp import demo
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.planning.memory import rank_state
    from ray_dhp.planning.step_peak import foreach_elements, largest_local

    config = demo.tiny_model_config("qwen2_5_vl")
    counts = count_params(config)
    fp32, mixed = POLICIES["fp32"], POLICIES["bf16_mixed"]

    def at(policy, **kw):
        topo = Topology.build(placement="collocated", **kw)
        text_up = rank_state(counts, topo, 0, policy).updated - counts.vision_updated_by(
            0, topo.vision.size, topo.vision.zero_stage)
        return foreach_elements(policy, counts, topo, 0, text_up), text_up

    n, text_up = at(fp32, vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    assert n == text_up > 0  # TP: the text module's DTensors, all it updates at once
    assert at(fp32, vision_dp=2, vision_sp=1, text_dp=2, text_tp=1)[0] == 0  # plain tensors: fused
    n, text_up = at(fp32, vision_dp=2, vision_sp=1, text_dp=2, text_tp=1, vision_zero=3)
    assert n == counts.vision_updated_by(0, 2, 3) > 0  # FSDP2's ViT shards
    n, text_up = at(mixed, vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    assert n == text_up  # the tiny model is one chunk of 64 MiB
    topo = Topology.build(placement="collocated", vision_dp=1, vision_sp=2, text_dp=1, text_tp=2)
    local = largest_local(counts, topo, text=True)  # the TP shard of the (tied) embedding
    assert local == config.text_config.vocab_size * config.text_config.hidden_size // 2
    # chunks of 4 KiB of masters: at least the largest local tensor at once, not the whole module
    assert foreach_elements(mixed, counts, topo, 0, text_up, chunk_bytes=4096) == local < text_up


def test_zero_1_update_frees_the_unowned_gradients_and_steps_the_owned_largest():
    """At ZeRO stages 1-2 the engine frees the gradients another replica updates before the
    update (`ray_dhp.step.updates`), and a rank steps only the tensors the partition gives it
    (`ray_dhp.parallel.zero.owners`: largest first, one to each replica): the step peak's update
    phase counts that (Cohere2-Vision's row, vision DP2 ZeRO-1: 1.166 -> measured in
    docs/plan_accuracy.md)."""
    from ray_dhp import demo
    from ray_dhp.models.sizes import count_params
    from ray_dhp.parallel.topology import Topology
    from ray_dhp.parallel.zero import owners
    from ray_dhp.planning.memory_state import rank_state
    from ray_dhp.planning.step_peak import _update_peak, largest_local

    config = demo.tiny_model_config("qwen2_5_vl")
    counts = count_params(config)
    topo = Topology.build(placement="collocated", vision_dp=2, vision_sp=1, text_dp=1, text_tp=2,
                          vision_zero=1)
    policy = POLICIES["fp32"]
    sizes = list(counts.vision_sizes)
    own = owners(sizes, 2)
    released = [rank_state(counts, topo, r, policy).released for r in (0, 1)]
    for r in (0, 1):
        assert released[r] == 4 * sum(n for n, o in zip(sizes, own) if o != r)
        assert largest_local(counts, topo, False, r) == max(n for n, o in zip(sizes, own) if o == r)
    assert sum(released) == 4 * sum(sizes)  # each gradient freed on the one replica not owning it
    assert largest_local(counts, topo, False, 1) < largest_local(counts, topo, False)
    state = rank_state(counts, topo, 1, policy)
    mine = largest_local(counts, topo, False, 1)
    update = _update_peak(state, policy, mine, None, fused_adamw=False)  # the update phase alone
    assert update == state.device_total - state.released + 2 * 4 * mine
