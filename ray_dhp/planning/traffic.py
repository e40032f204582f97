"""What crosses the network: bytes per optimizer step of each collective, and its rank groups.

The volumes are the ones `ray_dhp.planning.cost_model.phase_times` divides by a bandwidth (see its module
docstring for the derivation); `ray-dhp plan --nodes N --gpus-per-node G` prints them next to
the node boundary (`ray_dhp.cli.plan.nodes_text`). Plain data, no torch.distributed, no Ray.
"""

from __future__ import annotations

from ray_dhp.models.sizes import vision_width
from ray_dhp.planning.cost_types import Layout, Workload
from ray_dhp.planning.cost_model import _vision_spans, text_tokens_per_sample
from ray_dhp.parallel.topology import Topology


COLLECTIVES = ("vision sp all-to-all", "text tp all-reduce", "boundary", "vision gradients",
               "text dp gradients", "text expert all-to-all", "text expert gradients",
               "text cp all-to-all", "text cp ring")


def collective_bytes(config, counts, layout: Layout, w: Workload) -> dict:
    """Bytes one rank sends per optimizer step in each collective of ``layout`` (the volumes
    `phase_times` divides by a bandwidth): Ulysses all-to-alls and TP all-reduces over the
    ``M`` micro-batches, the boundary both ways, and the end-of-step gradient reductions (ring
    all-reduce: ``2 (n - 1) / n`` of the buffer; all-to-all: ``(n - 1) / n``). The gradient
    entries follow each module's ZeRO stage (`ray_dhp.parallel.zero.replica_bytes`: + the owners'
    broadcast at stages 1-2, reduce instead of all-reduce at 2, FSDP2's all-gathers and
    reduce-scatter in every micro-batch at 3), in the dtypes the engine sends
    (`element_bytes`). Under the LM's context parallelism each CP rank runs ``1 / cp`` of its
    replica's tokens outside attention (the TP all-reduces shrink so), re-shards q, k, v and the output per layer by all-to-all
    (forward, backward, and the recomputation with checkpointing: `cp_working_bytes`' send
    buffers) or, where ``tp x cp`` does not divide the heads, passes the K/V blocks around the
    ring (``text cp ring``: `ray_dhp.planning.ring_cost.ring_sent_bytes`), and its gradients
    join the data-parallel sum: the text gradients are reduced over the ``dp x cp`` replicas
    (`ray_dhp.parallel.topology.ModuleLayout.dp_groups`)."""
    from ray_dhp.planning.memory import cp_working_bytes
    from ray_dhp.planning.ring_cost import ring_form, ring_sent_bytes
    from ray_dhp.models import family_of
    from ray_dhp.parallel.zero import replica_bytes
    from ray_dhp.planning.experts import gradient_split, sent_bytes

    topo, s, m = layout.topology(), w.settings, w.micro_batches
    v, t = topo.vision, topo.text
    vc, tc = config.vision_config, config.text_config
    sv, st = -(-w.micro_batch_size // v.dp), -(-w.micro_batch_size // t.dp)
    x = sv * w.vision_tokens / v.inner * vision_width(vc) * s.dtype_bytes
    a2a = _vision_spans(vc)[0] * (3 * x + x) * (v.inner - 1) / v.inner  # one forward pass
    tok = st * text_tokens_per_sample(config, w.vision_tokens, w.text_tokens)
    n_ar = tc.num_hidden_layers * (6 if s.checkpointing else 4) + 1
    ar = n_ar * 2 * (t.inner - 1) / t.inner * tok / t.cp * tc.hidden_size * s.dtype_bytes
    cp_a2a, cp_ring = 0.0, 0.0
    if ring_form(tc, t.inner, t.cp):  # beyond the heads: ring attention's point-to-point
        cp_ring = tc.num_hidden_layers * ring_sent_bytes(tc, tok, t.inner, t.cp, s.dtype_bytes,
                                                         s.checkpointing)
    elif t.cp > 1:
        cp_a2a = tc.num_hidden_layers * (3 if s.checkpointing else 2) * (t.cp - 1) / t.cp \
            * cp_working_bytes(tc, tok, t.inner, t.cp, s) / 2
    feat = (w.vision_tokens // vc.spatial_merge_size ** 2) * family_of(config).feature_dim(config) \
        * s.dtype_bytes
    boundary = 2 * max(st * feat, sv * feat / v.inner * t.inner)
    g, wb = element_bytes(w)
    v_grads = replica_bytes(v.size, v.zero_stage, counts.vision * g, counts.vision * wb, m)
    # expert parallelism (`ray_dhp.planning.experts`): the token all-to-alls; the experts'
    # gradients summed over EDP (+ their owners' broadcast over the expert replicas at ZeRO 1-2)
    ep = topo.text_expert_parallel
    dense, experts = gradient_split(counts, t.inner, ep)
    t_grads = replica_bytes(t.dp * t.cp, t.zero_stage, dense * g, dense * wb, m)
    moe_a2a = sent_bytes(config, tok, ep, m, s.checkpointing, s.dtype_bytes)
    e_reps = t.inner * (t.dp * t.cp // ep)
    e_grads = (replica_bytes(t.dp * t.cp // ep, 0, experts * g, experts * wb)
               + (replica_bytes(e_reps, 1, 0, experts * wb) if t.zero_stage in (1, 2) else 0))
    out = dict(zip(COLLECTIVES, (m * a2a * (3 if s.checkpointing else 2), m * ar,
                                 m * boundary, v_grads, t_grads, moe_a2a, e_grads, m * cp_a2a,
                                 m * cp_ring)))
    a = topo.encoder("audio")
    if a is not None:  # the audio rows to the LM both ways, the audio gradients
        from ray_dhp.planning.memory_audio import clip_shape

        rows = clip_shape(config.audio_config, w.audio_seconds).lm_tokens
        feat = rows * config.audio_config.output_dim * s.dtype_bytes
        sa, params = -(-w.micro_batch_size // a.dp), w.audio_params.params
        out["audio boundary"] = m * 2 * max(st * feat, sa * feat * t.inner)
        out["audio gradients"] = replica_bytes(a.size, a.zero_stage, params * g, params * wb)
    return out


def element_bytes(w: Workload) -> tuple:
    """``(gradient, weight)`` bytes per parameter entry the replicas exchange. With the run's
    policy (``w.policy``, `ray_dhp.step.precision`): the gradients are summed in its
    ``reduce_dtype`` (fp32 under every policy: bf16 weights accumulate fp32 gradients), and the
    owners' broadcast of the new values (ZeRO 1-2) and FSDP2's all-gathers (stage 3, no
    ``param_dtype`` cast) move the weights the modules hold, in ``param_dtype`` (bf16 under
    ``bf16_mixed``, whose fp32 masters stay on their owners, and ``bf16``). Without a policy:
    fp32 weights, and gradients of 2 bytes when ``w.state_bytes`` is under 16."""
    if w.policy is None:
        return (4 if w.state_bytes >= 16 else 2), 4
    return w.policy.reduce_dtype.itemsize, w.policy.weight_bytes()


def boundary_pairs(topology: Topology, micro_batch_size: int, encoder: str = "vision") -> list:
    """``[(encoder ranks, text ranks)]`` that exchange features: a replica of ``encoder`` and a
    text replica sharing samples (both split a micro-batch into contiguous, even shares)."""
    from ray_dhp.parallel.boundary import split_evenly

    v, t = topology.module(encoder), topology.text
    vs, ts = split_evenly(micro_batch_size, v.dp), split_evenly(micro_batch_size, t.dp)
    out = []
    for i, a in enumerate(vs):
        for j, b in enumerate(ts):
            if set(a) & set(b):
                out.append((v.inner_groups()[i], t.inner_groups()[j]))
    return out


def collective_groups(topology: Topology, micro_batch_size: int) -> dict:
    """The rank groups of each collective in `COLLECTIVES` (boundary: each exchanging pair)."""
    v, t = topology.vision, topology.text

    def pairs(encoder):
        return [sorted(set(a + b)) for a, b in boundary_pairs(topology, micro_batch_size, encoder)
                if len(set(a + b)) > 1]

    out = dict(zip(COLLECTIVES, (
        v.inner_groups() if v.inner > 1 else [], t.inner_groups() if t.inner > 1 else [],
        pairs("vision"), [v.ranks] if v.size > 1 else [],
        t.dp_groups() if t.dp * t.cp > 1 else [],  # the gradient replicas: dp x cp ranks
        *_expert_groups(topology), *[t.cp_groups() if t.cp > 1 else []] * 2)))
    a = topology.encoder("audio")
    if a is not None:
        out.update({"audio boundary": pairs("audio"),
                    "audio gradients": [a.ranks] if a.size > 1 else []})
    return out


def _expert_groups(topology: Topology) -> tuple:
    """(EP groups, expert replica groups) of ``topology`` ([] without expert parallelism)."""
    ep = topology.text_expert_parallel
    if ep <= 1:
        return [], []
    from ray_dhp.parallel.expert import ep_groups, replica_groups

    reps = replica_groups(topology.text, ep)
    return ep_groups(topology.text, ep), reps if len(reps[0]) > 1 else []
