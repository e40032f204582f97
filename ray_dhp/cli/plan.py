"""``ray-dhp plan``: the resolved layout and a per-rank memory estimate, without Ray or weights."""

from __future__ import annotations

from ray_dhp.memory import (GIB, ActivationSettings, count_params, estimate_ranks, estimate_zero3,
                            rank_state)


def _gib(b: float) -> str:
    return f"{b / GIB:7.2f} GiB" if b >= GIB / 10 or b == 0 else f"{b / 2**20:7.2f} MiB"


def _num(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _meshes(topology) -> list:
    lines = []
    for m in (topology.vision, topology.text):
        lines.append(f"  {m.name} mesh (\"dp\", \"{m.inner_dim}\") = {m.mesh()}")
        lines.append(f"    {m.inner_dim} groups {m.inner_groups()}, dp groups {m.dp_groups()}")
    return lines


def policy_of_run(rf):
    """The `PrecisionPolicy` of the run file (optim.precision / optim.autocast_dtype): the same
    object the engine builds from its train_loop_config."""
    from ray_dhp.precision import policy_of

    return policy_of(rf.optim)


def settings_of(rf, attention: str) -> ActivationSettings:
    """Activation settings implied by the run file (precision policy, checkpointing)."""
    import torch

    p = policy_of_run(rf)
    bf16 = torch.bfloat16 in (p.param_dtype, p.autocast_dtype)
    return ActivationSettings(dtype_bytes=2 if bf16 else 4,
                              attention=attention, checkpointing=rf.optim.activation_checkpointing)


def samples_per_replica(rf, topology) -> int:
    """Samples one replica processes per micro-batch (the larger of the two groups' shares)."""
    mb = rf.optim.global_batch_size // rf.optim.micro_batches
    return max(1, -(-mb // min(topology.vision.dp, topology.text.dp)))


def plan_text(rf, *, vision_tokens: list, text_tokens: int, attention: str = "flash",
              device_gib: float = 80.0) -> str:
    """The full `ray-dhp plan` report for the run file ``rf``."""
    dhp = rf.dhp_config()
    topo, config = dhp.topology(), dhp.model_config()
    num_workers = rf.num_workers(dhp)
    counts = count_params(config)
    tp = topo.text.inner
    settings = settings_of(rf, attention)
    samples = samples_per_replica(rf, topo)
    zero1 = bool(getattr(rf.optim, "vision_zero1", False))
    policy = policy_of_run(rf)
    out = [
        f"model: {config.model_type}; parameters: vision {_num(counts.vision)}, "
        f"text {_num(counts.text)} ({_num(counts.text_sharded)} tensor-parallel)",
        f"workers: {num_workers} (scaling.use_gpu={rf.scaling.use_gpu})",
        "layout:", topo.describe(), "meshes:", *_meshes(topo),
        "",
        f"precision (optim.precision): {policy.describe()}",
        "per-rank model state (held by the rank; masters and AdamW moments only for what it "
        f"updates{', the ViT split by vision ZeRO-1' if zero1 else ''}); start-up peak = weights "
        "+ masters + one full fp32 tensor (the largest, "
        f"{_num(counts.largest)} elements) while the engine is built:",
    ]
    for r in range(topo.world_size):
        roles = topo.roles(r)
        v = counts.vision if "vision" in roles else 0
        t = counts.text_per_rank(tp) if "text" in roles else 0
        st = rank_state(counts, topo, r, policy, zero1)
        out.append(f"  rank {r} [{'+'.join(roles)}]: vision {_num(v)} + text {_num(t)} params; "
                   f"weights {_gib(st.weights)}, grads {_gib(st.grads)}, masters "
                   f"{_gib(st.masters)}, AdamW {_gib(st.optimizer)} = state {_gib(st.total)}; "
                   f"start-up peak {_gib(st.startup_peak)}")
    out += ["", f"activation estimate: {samples} sample(s) per replica per micro-batch, "
                f"{text_tokens} text tokens per sample, {settings.dtype_bytes}-byte activations, "
                f"{attention} attention, activation checkpointing "
                f"{'on' if settings.checkpointing else 'off'}, vision ZeRO-1 "
                f"{'on' if zero1 else 'off'}; device {device_gib:g} GiB"]
    for vt in vision_tokens:
        out.append(f"vision tokens per sample = {vt}:")
        for m in estimate_ranks(config, topo, counts, vision_tokens=vt, text_tokens=text_tokens,
                                samples=samples, settings=settings, vision_zero1=zero1,
                                policy=policy):
            flag = "fits" if m.total <= device_gib * GIB else "EXCEEDS device"
            out.append(f"  rank {m.rank} memory: state {_gib(m.state_bytes)} + vision act "
                       f"{_gib(m.vision_act)} + text act {_gib(m.text_act)} = {_gib(m.total)}"
                       f"  [{flag}]")
        z = estimate_zero3(config, counts, topo.world_size, vision_tokens=vt,
                           text_tokens=text_tokens, settings=settings,
                           state_bytes=policy.state_bytes())
        out.append(f"  (reference: ZeRO-3 over {topo.world_size} GPUs, one sample per GPU, no SP/TP:"
                   f" {_gib(z)} per GPU [{'fits' if z <= device_gib * GIB else 'EXCEEDS device'}])")
    return "\n".join(out)
