"""``ray-dhp plan``: the resolved layout and a per-rank memory estimate, without Ray or weights."""

from __future__ import annotations

from ray_dhp.memory import GIB, ActivationSettings, count_params, estimate_ranks, estimate_zero3


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


def settings_of(rf, attention: str) -> ActivationSettings:
    """Activation settings implied by the run file (autocast dtype, checkpointing)."""
    return ActivationSettings(dtype_bytes=2 if rf.optim.autocast_dtype == "bfloat16" else 4,
                              attention=attention, checkpointing=rf.optim.activation_checkpointing)


def samples_per_replica(rf, topology) -> int:
    """Samples one replica processes per micro-batch (the larger of the two groups' shares)."""
    mb = rf.optim.global_batch_size // rf.optim.micro_batches
    return max(1, -(-mb // min(topology.vision.dp, topology.text.dp)))


def plan_text(rf, *, vision_tokens: list, text_tokens: int, attention: str = "flash",
              device_gib: float = 80.0, state_bytes: float = 16.0) -> str:
    """The full `ray-dhp plan` report for the run file ``rf``."""
    dhp = rf.dhp_config()
    topo, config = dhp.topology(), dhp.model_config()
    num_workers = rf.num_workers(dhp)
    counts = count_params(config)
    tp = topo.text.inner
    settings = settings_of(rf, attention)
    samples = samples_per_replica(rf, topo)
    zero1 = bool(getattr(rf.optim, "vision_zero1", False))
    out = [
        f"model: {config.model_type}; parameters: vision {_num(counts.vision)}, "
        f"text {_num(counts.text)} ({_num(counts.text_sharded)} tensor-parallel)",
        f"workers: {num_workers} (scaling.use_gpu={rf.scaling.use_gpu})",
        "layout:", topo.describe(), "meshes:", *_meshes(topo),
        "",
        f"per-rank parameters (held by the rank; state = {state_bytes:g} B/param; 16 = fp32 weights "
        "+ grads + AdamW, the engine's default):",
    ]
    for r in range(topo.world_size):
        roles = topo.roles(r)
        v = counts.vision if "vision" in roles else 0
        t = counts.text_per_rank(tp) if "text" in roles else 0
        out.append(f"  rank {r} [{'+'.join(roles)}]: vision {_num(v)} + text {_num(t)}"
                   f" params; weights {_gib((v + t) * 4)}, state {_gib((v + t) * state_bytes)}")
    out += ["", f"activation estimate: {samples} sample(s) per replica per micro-batch, "
                f"{text_tokens} text tokens per sample, {settings.dtype_bytes}-byte activations, "
                f"{attention} attention, activation checkpointing "
                f"{'on' if settings.checkpointing else 'off'}, vision ZeRO-1 "
                f"{'on' if zero1 else 'off'}; device {device_gib:g} GiB"]
    for vt in vision_tokens:
        out.append(f"vision tokens per sample = {vt}:")
        for m in estimate_ranks(config, topo, counts, vision_tokens=vt, text_tokens=text_tokens,
                                samples=samples, settings=settings,
                                 state_bytes=state_bytes, vision_zero1=zero1):
            flag = "fits" if m.total <= device_gib * GIB else "EXCEEDS device"
            out.append(f"  rank {m.rank} memory: state {_gib(m.state_bytes)} + vision act "
                       f"{_gib(m.vision_act)} + text act {_gib(m.text_act)} = {_gib(m.total)}"
                       f"  [{flag}]")
        z = estimate_zero3(config, counts, topo.world_size, vision_tokens=vt,
                           text_tokens=text_tokens, settings=settings, state_bytes=state_bytes)
        out.append(f"  (reference: ZeRO-3 over {topo.world_size} GPUs, one sample per GPU, no SP/TP:"
                   f" {_gib(z)} per GPU [{'fits' if z <= device_gib * GIB else 'EXCEEDS device'}])")
    return "\n".join(out)
