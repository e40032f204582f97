"""``ray-dhp plan --recommend``: the layouts the cost model prefers, and a run-file fragment."""

from __future__ import annotations

import math
from collections import Counter

from ray_dhp.cli.plan import policy_of_run, settings_of
from ray_dhp.planning.packing import packing_of
from ray_dhp.cli.schema import ConfigError


def default_workers(rf) -> int:
    """The run file's worker count: ``scaling.num_workers``, else the size of its layout."""
    if rf.scaling.num_workers:
        return rf.scaling.num_workers
    from ray_dhp.parallel.topology import EncoderDegrees, Topology

    audio = ({"audio": EncoderDegrees(dp=rf.audio.data_parallel, sp=rf.audio.sequence_parallel)}
             if rf.audio is not None else None)
    try:
        return Topology.build(placement=rf.placement.mode, vision_dp=rf.vision.data_parallel,
                              vision_sp=rf.vision.sequence_parallel, text_dp=rf.text.data_parallel,
                              text_tp=rf.text.tensor_parallel, encoders=audio).world_size
    except ValueError as e:
        raise ConfigError(f"{e} (or pass --gpus N)") from None


def parse_vision_tokens(text: str) -> tuple:
    """``--vision-tokens``: ``(sizes, mix)``. ``"4096"`` or ``"1024,4096"``: sizes, no mix (plan
    prints one estimate per size, the recommendation plans for the largest). ``"256:0.7,4096:0.25,
    16384:0.05"``: a resolution mix, ``size:weight`` (weights normalised to fractions)."""
    items = [x.strip() for x in str(text).split(",") if x.strip()]
    with_weight = [":" in x for x in items]
    try:
        if not any(with_weight):
            sizes = [int(x) for x in items]
            mix = None
        elif all(with_weight):
            pairs = [(int(a), float(b)) for a, b in (x.split(":", 1) for x in items)]
            total = sum(w for _, w in pairs)
            if any(w <= 0 for _, w in pairs) or len({v for v, _ in pairs}) < len(pairs):
                raise ValueError
            mix = tuple((v, w / total) for v, w in sorted(pairs))
            sizes = [v for v, _ in mix]
        else:
            raise ValueError
    except ValueError:
        raise ConfigError(f"--vision-tokens {text!r}: give sizes (4096 or 1024,4096) or a mix of "
                          "distinct sizes with weights > 0 (256:0.7,4096:0.25,16384:0.05)") from None
    if not sizes or min(sizes) < 1:
        raise ConfigError(f"--vision-tokens {text!r}: sizes must be >= 1")
    return sizes, mix


def _workload_line(vt, text_tokens, vision_tokens, vision_mix) -> str:
    if vision_mix is not None:
        mix = ", ".join(f"{v} ({f:.0%})" for v, f in vision_mix)
        return (f"workload: {mix} vision + {text_tokens} text tokens per sample (a resolution "
                f"mix, shared out by cost as with optim.balance: cost; memory planned for {vt})")
    return (f"workload: {vt} vision + {text_tokens} text tokens per sample"
            + (f" (the largest of --vision-tokens {','.join(map(str, vision_tokens))})"
               if len(vision_tokens) > 1 else ""))


def _fragment_yaml(cand, micro_batches_override) -> str:
    import yaml

    frag = cand.layout.run_file_fragment()
    if micro_batches_override is not None:
        frag["optim"] = {"micro_batches": micro_batches_override}
    return yaml.safe_dump(frag, sort_keys=False, default_flow_style=False)


def _row(i, c) -> str:
    lay, idle = c.layout, c.idle_fraction
    both = idle.get("vision+text", idle.get("vision+audio+text", 0.0))  # collocated: one group
    iv, it = idle.get("vision", both), idle.get("text", both)
    text = f"tp{lay.text_tp}{'+sp' if lay.text_sp else ''} x dp{lay.text_dp}" \
        + (f" ep{lay.text_ep}" if lay.text_ep > 1 else "")
    audio = f"{f'dp{lay.audio_dp}':<7}{idle.get('audio', both):5.2f}  " if lay.audio_dp else ""
    return (f"{i:>3}  {lay.placement:<10}  {lay.schedule:<10}  "
            f"{f'sp{lay.vision_sp} x dp{lay.vision_dp}':<11} {audio}{text:<14}"
            f" {c.step_s:9.4g}  {iv:11.2f}  {it:9.2f}  {c.peak_memory_gib:8.3g}"
            f"  {_zero(lay)}")


def _zero(lay) -> str:
    return "/".join(str(m.zero_stage) for m in lay.topology().modules)


def build_workload(rf, *, micro_batches, vision_tokens: list, text_tokens: int, attention: str,
                   budget, vision_mix=None, videos=None, audio_seconds: float = 30.0) -> tuple:
    """``(config, counts, Workload, workload line or None, audio kwargs, LLM audio tokens)`` of
    the run file ``rf`` for a recommendation (`recommend_text`, the pool planner
    `ray_dhp.cli.pool_report`); ``budget``: the device memory and margin (None: 0, each pool
    has its own)."""
    from ray_dhp.models import load_model_config
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Workload

    m = micro_batches if micro_batches is not None else rf.optim.micro_batches
    gb = rf.optim.global_batch_size
    if m < 1 or gb % m:
        raise ConfigError(f"--micro-batches {m}: must be >= 1 and divide optim.global_batch_size={gb}.")
    config = load_model_config(rf.model_spec())
    counts = count_params(config)
    settings = settings_of(rf, attention)
    policy = policy_of_run(rf)  # the engine's precision policy (precision.policy)
    vt, segment, line = max(vision_tokens), None, None
    if videos:
        from ray_dhp.cli.plan import vision_cases

        line, vt, segment = max(vision_cases(config, vision_tokens, videos), key=lambda c: c[1])
        line = f"workload: {line.rstrip(':')} + {text_tokens} text tokens"
    audio, lm_audio = {}, 0
    if rf.audio is not None:  # three modules: one clip per sample, its rows in the LM's sequence
        from ray_dhp.planning.memory_audio import count_audio, lm_audio_tokens

        lm_audio = lm_audio_tokens(config, audio_seconds)
        audio = dict(audio_seconds=audio_seconds, audio_params=count_audio(config))
    device = dict(device_gib=budget.memory_gib, margin_gib=budget.margin_gib) if budget else {}
    w = Workload(vision_tokens=vt, text_tokens=text_tokens + lm_audio, global_batch_size=gb,
                 micro_batches=m, settings=settings, state_bytes=float(policy.state_bytes()),
                 policy=policy, vision_mix=vision_mix, vision_segment=segment,
                 packing=packing_of(rf), **device, **audio)
    return config, counts, w, line, audio, lm_audio


def recommend_text(rf, *, gpus, micro_batches, vision_tokens: list, text_tokens: int,
                   attention: str = "flash", budget=None, hardware=None,
                   top: int = 8, vision_mix=None, videos=None, audio_seconds: float = 30.0,
                   context_parallel: bool = False) -> tuple:
    """(report, ok): the ranked layouts for the run file ``rf`` on ``gpus`` workers (None: the
    run file's count) and the fragment of the best one; ``ok`` is False when none fits.
    ``vision_mix``: a resolution mix ``((tokens, fraction), ...)`` (`parse_vision_tokens`);
    ``videos`` (``--video``): plan for the longest of them instead (its tokens, per-frame
    attention). With an ``audio:`` section every layout has an audio group and each sample one
    clip of ``audio_seconds``. ``budget``: the `ray_dhp.planning.devices.DeviceBudget` every
    layout must fit (its memory less its margin; default: `DEFAULT_GPU`'s)."""
    from ray_dhp.cli.plan import _num
    from ray_dhp.planning.recommend import Hardware, recommend

    from ray_dhp.planning.devices import budget_of

    hw = hardware or Hardware()
    budget = budget or budget_of(None)
    n = gpus if gpus is not None else default_workers(rf)
    if n < 1:
        raise ConfigError(f"--gpus {n}: need at least one GPU.")
    config, counts, w, line, audio, lm_audio = build_workload(
        rf, micro_batches=micro_batches, vision_tokens=vision_tokens, text_tokens=text_tokens,
        attention=attention, budget=budget, vision_mix=vision_mix, videos=videos,
        audio_seconds=audio_seconds)
    m, gb, settings, policy = w.micro_batches, w.global_batch_size, w.settings, w.policy
    state_bytes, vt = w.state_bytes, w.vision_tokens
    cands = recommend(config, n, w, hw, counts=counts, context_parallel=context_parallel)
    ok = [c for c in cands if c.feasible]
    a_num = f"audio {_num(audio['audio_params'].params)}, " if audio else ""
    t_num = counts.text - (audio["audio_params"].params if audio else 0)
    out = [
        f"recommendation for {n} GPUs: {config.model_type} (vision {_num(counts.vision)}, {a_num}"
        f"text {_num(t_num)} parameters)",
        (line or _workload_line(vt, text_tokens, vision_tokens, vision_mix))
        + (f" + one {audio_seconds:g} s audio clip ({lm_audio} LLM tokens)" if audio else "")
        + f"; global batch {gb} = {m} micro-batch(es) of {w.micro_batch_size}; "
        f"{settings.dtype_bytes}-byte activations, {attention} attention, checkpointing "
        f"{'on' if settings.checkpointing else 'off'}, ZeRO stages: the defaults (1 with "
        f"more than one replica) or, where they do not fit, the fastest pair that does, {policy.name} state ({state_bytes:g} B/param); {budget.describe()} "
        "per GPU",
        f"cost model (ray_dhp/planning/cost_model.py): {hw.flops(settings.dtype_bytes) / 1e12:.0f} TFLOP/s "
        f"achieved per GPU ({hw.efficiency:.2f} of peak), links {hw.link_bw / 1e9:.0f} GB/s in a "
        f"node / {hw.internode_bw / 1e9:.0f} GB/s between nodes, {hw.gpus_per_node} GPUs per node",
        "",
        "  #  placement   schedule    vision      " + ("audio  idle  " if audio else "")
        + "text            step (s)  vision idle  text idle  GiB/GPU  ZeRO "
        + ("v/a/t" if audio else "v/t"),
    ]
    out += [_row(i + 1, c) for i, c in enumerate(ok[:top])]
    if not ok:
        out.append("  (no layout fits)")
    dropped = [c for c in cands if not c.feasible]
    kinds = Counter(c.reason.split(":", 1)[0] for c in dropped)
    if dropped:
        out += ["", f"dropped {len(dropped)} of {len(cands)} layouts ("
                + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) + "); first dropped:"]
        out += [f"  {c.layout.describe()}: " + ("" if math.isnan(c.step_s) else f"{c.step_s:.4g} s; ")
                + c.reason for c in dropped[:3]]
    if ok:
        best = ok[0]
        out += ["", f"recommended: {best.layout.describe()} ({best.step_s:.4g} s per step, "
                    f"{best.peak_memory_gib:.3g} GiB per GPU). Run-file fragment:", "",
                _fragment_yaml(best, micro_batches).rstrip()]
    else:
        out += ["", "no layout fits: use precision.policy=bf16 (10 B/param), turn on activation "
                    "checkpointing or bf16 autocast, shorten the samples, or add GPUs."]
    return "\n".join(out), bool(ok)
