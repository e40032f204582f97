"""``ray-dhp plan``: the resolved layout and a per-rank memory estimate, without Ray or weights."""

from __future__ import annotations

from ray_dhp.planning.memory import GIB, ActivationSettings, estimate_zero3

from ray_dhp.models.sizes import count_params
from ray_dhp.planning.memory_audio import (audio_activation_bytes, clip_shape, count_audio,
                                           estimate_module_ranks, lm_audio_tokens,
                                           module_rank_state, without_audio)
from ray_dhp.planning.step_peak import audio_updated, rank_step_peak
from ray_dhp.planning.packing import packing_of


def _gib(b: float) -> str:
    return f"{b / GIB:7.2f} GiB" if b >= GIB / 10 or b == 0 else f"{b / 2**20:7.2f} MiB"


def _num(n: int) -> str:
    return f"{n / 1e9:.3f} B" if n >= 1e8 else f"{n / 1e6:.3f} M"


def _meshes(topology) -> list:
    lines = []
    for m in topology.modules:
        lines.append(f"  {m.name} mesh (\"dp\", \"{m.inner_dim}\") = {m.mesh()}")
        lines.append(f"    {m.inner_dim} groups {m.inner_groups()}, dp groups {m.dp_groups()}")
        if m.cp > 1:  # mesh rows are the dp x cp gradient replicas
            lines.append(f"    context parallel {m.cp} (text.context_parallel; each replica's "
                         f"sequence in {m.cp} slices, LM activations ~1/(tp x cp)): cp groups "
                         f"{m.cp_groups()}; dp groups above = dp x cp ranks (gradients, ZeRO)")
    return lines


def policy_of_run(rf):
    """The `PrecisionPolicy` of the run file (precision.policy): the same
    object the engine builds from its train_loop_config."""
    from ray_dhp.step.precision import policy_of

    return policy_of(rf.precision)


def settings_of(rf, attention: str) -> ActivationSettings:
    """Activation settings implied by the run file (precision policy, checkpointing)."""
    return ActivationSettings.of(policy_of_run(rf), attention, rf.optim.activation_checkpointing)


def samples_per_replica(rf, topology) -> dict:
    """``{module: samples one of its replicas processes per micro-batch}``: each group splits the
    micro-batch over its own data-parallel degree (vision DP1 beside text DP8: 8 and 1). A
    micro-batch smaller than a module's degree is refused, as the engine refuses it at its
    first step (`ray_dhp.step.microbatch.layout_micro_batch`)."""
    from ray_dhp.cli.schema import ConfigError

    o = rf.optim
    mb = o.global_batch_size // o.micro_batches
    for m in topology.modules:
        if mb < m.dp:
            raise ConfigError(f"optim.global_batch_size: a micro-batch of {mb} sample(s) "
                              f"(global_batch_size {o.global_batch_size} / micro_batches "
                              f"{o.micro_batches}) cannot feed the {m.dp} {m.name} replicas "
                              f"({m.name}.data_parallel); raise optim.global_batch_size or lower "
                              "optim.micro_batches.")
    return {m.name: -(-mb // m.dp) for m in topology.modules}


def _fits(total: float, budget) -> str:
    """The verdict on a rank's planned peak: ``[fits]`` only below the device's memory less its
    margin (`ray_dhp.planning.devices.DeviceBudget`); nothing without a device."""
    if budget is None:
        return ""
    return "  [fits]" if budget.fits(total) else "  [EXCEEDS device less margin]"


def budget_of_run(rf, device=None, device_gib=None, margin_gib=None, gpu=None):
    """The `ray_dhp.planning.devices.DeviceBudget` a plan of ``rf`` checks: the accelerator
    ``device`` (``--device``) or ``scaling.accelerator`` (default `DEFAULT_GPU`), its memory
    replaced by ``device_gib`` (``--device-gib``), its margin by ``margin_gib``
    (``--device-margin-gib``) or ``scaling.device_margin_gib``. None (no limit checked) for a
    CPU run that names no device nor margin (``gpu``: plan for a GPU anyway, as ``--recommend``
    does).
    ConfigError naming the flag or key at fault."""
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.planning.devices import budget_of

    sc = rf.scaling
    if not (gpu or sc.use_gpu or device or sc.accelerator or device_gib is not None
            or margin_gib is not None):
        return None
    name_key = "--device" if device else "scaling.accelerator"
    if margin_gib is not None:
        margin_key = "--device-margin-gib"
    elif sc.device_margin_gib is not None:
        margin_key, margin_gib = "scaling.device_margin_gib", sc.device_margin_gib
    else:  # the kind's default margin: only a too small --device-gib leaves no room for it
        margin_key = "--device-gib" if device_gib is not None else name_key
    try:
        return budget_of(device or sc.accelerator, device_gib, margin_gib, margin_key=margin_key)
    except ValueError as e:
        raise ConfigError(str(e).replace("scaling.accelerator", name_key, 1)) from None


def headroom_line(budget, peaks: dict) -> str:
    """The most loaded rank's peak against ``budget``: what stays free after the margin, as a
    fraction of the device's memory (``HEADROOM_RE`` reads it back)."""
    r = max(peaks, key=peaks.get)
    free, pct = budget.usable_gib * GIB - peaks[r], budget.headroom(peaks[r])
    return (f"  headroom: rank {r} peaks at {peaks[r] / GIB:.2f} GiB: " +
            (f"{free / GIB:.2f} GiB ({pct:.1%} of the device) free after the margin" if free >= 0
             else f"{-free / GIB:.2f} GiB over the device less its margin ({pct:.1%})"))


#: Reads `headroom_line` back: rank, peak GiB, headroom percent.
HEADROOM_RE = r"headroom: rank (\d+) peaks at ([\d.]+) GiB: .*?\((-?[\d.]+)%"


def _too_long(rf, vision_tokens: int, text_tokens: int, merge: int = 4):
    """The sample's tokens if they exceed data.max_tokens (such samples are skipped), else None."""
    n = vision_tokens // merge + text_tokens
    return n if rf.data.max_tokens is not None and n > rf.data.max_tokens else None


def vision_cases(config, vision_tokens: list, videos=None) -> list:
    """``(heading, patch tokens, attention segment)`` per estimate: one per ``--vision-tokens``
    size (one image, segment None), or one per ``--video`` (`ray_dhp.planning.video.VideoShape`:
    its tokens, attending per frame)."""
    if not videos:
        return [(f"vision tokens per sample = {vt}:", vt, None) for vt in vision_tokens]
    from ray_dhp.cli.schema import ConfigError

    vc, out = config.vision_config, []
    for v in videos:
        try:
            t, h, w = v.grid(vc)
        except ValueError as e:
            raise ConfigError(f"--video: {e}") from None
        n = t * h * w
        out.append((f"video {v.describe()} per sample ({v.frames} frames = {t} temporal patches "
                    f"of {h}x{w} patches: {n} vision tokens, {n // vc.spatial_merge_size ** 2} "
                    f"LLM tokens; attention per frame of {h * w} patches):", n, h * w))
    return out


def plan_text(rf, *, vision_tokens: list, text_tokens: int, attention=None,
              device_gib=None, videos=None, audio_seconds: float = 30.0, device=None,
              margin_gib=None) -> str:
    """The full `ray-dhp plan` report for the run file ``rf``. ``attention`` defaults to flash
    with ``scaling.use_gpu``, on CPU to eager (scores counted in full). The device checked
    (`budget_of_run`): ``device`` / ``device_gib`` / ``margin_gib`` (``--device``,
    ``--device-gib``, ``--device-margin-gib``) over ``scaling.accelerator`` /
    ``scaling.device_margin_gib``; on CPU, naming none, no device limit. A rank's planned peak
    is the largest of its state plus activations, its step peak and its start-up peak; it
    ``[fits]`` only below the device's memory less the margin. ``videos``
    (`ray_dhp.planning.video.VideoShape`, from ``--video``) replace ``vision_tokens``: one
    estimate per video. ``audio_seconds``: with an audio group (``audio:``), each sample also
    carries one clip this long."""
    gpu = rf.scaling.use_gpu
    attention = attention or ("flash" if gpu else "eager")
    budget = budget_of_run(rf, device, device_gib, margin_gib)
    device = budget.describe() if budget is not None else "CPU: no device limit"
    dhp = rf.dhp_config(with_processor=False)
    topo, config = dhp.topology(), dhp.model_config()
    num_workers = rf.num_workers(dhp)
    from ray_dhp.config.tuning import tuning_of

    tuning = tuning_of(rf.optim)  # optim.modules: frozen parts hold weights only
    counts = count_params(config, None if tuning.default else tuning)
    audio = count_audio(config, tuning) if topo.encoder("audio") is not None else None
    base = without_audio(counts) if audio is not None else counts  # what vision/text ranks hold
    settings = settings_of(rf, attention)
    samples = samples_per_replica(rf, topo)
    policy = policy_of_run(rf)
    out = [
        f"model: {config.model_type}; parameters: vision {_num(counts.vision)}, "
        + (f"audio {_num(audio.params)}, " if audio is not None else "")
        + f"text {_num(base.text)} ({_num(counts.text_sharded)} tensor-parallel)",
        *([f"frozen (optim.modules): vision {_num(counts.vision_frozen)}, text "
           f"{_num(counts.text_frozen)}"] if counts.vision_frozen or counts.text_frozen else []),
        f"workers: {num_workers} (scaling.use_gpu={rf.scaling.use_gpu})",
        "layout:", topo.describe(), *_labels_lines(rf, topo), "meshes:", *_meshes(topo),
        "",
        f"precision (precision.policy): {policy.describe()}",
        "per-rank model state (held by the rank; masters and AdamW moments only for what it "
        f"updates; ZeRO stages: {_stages(topo, ', ')}); "
        "start-up peak = weights "
        "+ masters + one full fp32 tensor (the largest, "
        f"{_num(counts.largest)} elements) while the engine is built; step peak = state + the "
        "all-reduce bucket or the fp32 master gradients of one chunk (ray_dhp.planning.step_peak); "
        "checkpoint staging = host memory for one copy of the checkpoint state "
        "(checkpoint.async_save):",
    ]
    floor = {}  # rank: its step and start-up peaks (with activations gone / not yet there)
    for r in range(topo.world_size):
        roles = topo.roles(r)
        vg = topo.vision  # a module's FSDP shard at stage 3
        v = counts.vision_held_by(r - vg.offset, vg.size, vg.zero_stage) if "vision" in roles else 0
        a = audio.params if audio is not None and "audio" in roles else 0
        st = module_rank_state(counts, audio, topo, r, policy, rf.optim.micro_batches)
        t = st.params - v - a
        ag = topo.encoder("audio")
        a_reduced = a if a and ag.size > 1 else 0
        a_up = audio_updated(audio, topo, r, policy) if a else 0
        step = rank_step_peak(st, policy, base, topo, r, config.text_config, a_reduced, a_up)
        floor[r] = max(step, st.startup_peak)
        out.append(f"  rank {r} [{'+'.join(roles)}]: vision {_num(v)} + "
                   + (f"audio {_num(a)} + " if audio is not None else "")
                   + f"text {_num(t)} params; "
                   f"weights {_gib(st.weights)}, grads {_gib(st.grads)}, masters "
                   f"{_gib(st.masters)}, AdamW {_gib(st.optimizer)} = state {_gib(st.total)}; "
                   f"start-up peak {_gib(st.startup_peak)}; step peak "
                   f"{_gib(step)}; "
                   + (f"offloaded to the host: {_gib(st.host)} (device state "
                      f"{_gib(st.device_total)}); " if st.host else "")
                   + f"host: checkpoint staging "
                   f"{_gib(st.staging) if rf.checkpoint.async_save else '0 (async_save off)'}")
    shares = ", ".join(f"{name} {n}" for name, n in samples.items())
    packing = packing_of(rf)
    out += ["", f"activation estimate: sample(s) per replica per micro-batch: {shares}; "
                f"{text_tokens} text tokens per sample, "
                f"{'padded' if packing is None else packing.describe()}, "
                f"{settings.dtype_bytes}-byte activations, "
                f"{attention} attention, activation checkpointing "
                f"{'on' if settings.checkpointing else 'off'}, ZeRO stages "
                f"{_stages(topo, ' / ')}; {device}"]
    lm_audio = 0
    if audio is not None:
        clip, lm_audio = clip_shape(config.audio_config, audio_seconds), lm_audio_tokens(config, audio_seconds)
        out.append(f"audio: one {audio_seconds:g} s clip per sample (--audio-seconds), "
                   f"{_audio_samples(rf, topo)} clip(s) per audio replica per micro-batch: "
                   f"{clip.frames} mel frames, {clip.tokens} audio-encoder tokens (attention in "
                   f"chunks of {clip.chunk_tokens}), {lm_audio - 2} + 2 LLM tokens")
    for heading, vt, seg in vision_cases(config, vision_tokens, videos):
        out.append(heading)
        too_long = _too_long(rf, vt, text_tokens + lm_audio)
        if too_long is not None:
            out.append(f"  samples of {too_long} tokens ({vt} // 4 + {text_tokens + lm_audio}) exceed "
                       f"data.max_tokens={rf.data.max_tokens}: skipped as bad data")
            continue
        peaks = {}
        for m in estimate_module_ranks(config, topo, counts, audio, audio_seconds=audio_seconds,
                                       audio_samples=_audio_samples(rf, topo),
                                       vision_tokens=vt, text_tokens=text_tokens,
                                       samples=samples["vision"],
                                       text_samples=samples["text"], settings=settings,
                                       policy=policy, segment_tokens=seg, packing=packing,
                                       micro_batches=rf.optim.micro_batches):
            peaks[m.rank] = max(m.total, floor[m.rank])
            out.append(f"  rank {m.rank} memory: state {_gib(m.state_bytes)} + vision act "
                       f"{_gib(m.vision_act)} + "
                       + (f"audio act {_gib(m.audio_act)} + " if audio is not None else "")
                       + f"text act {_gib(m.text_act)} "
                       + (f"+ CP {_cp_form(config, topo)} buffers {_gib(m.text_work)} " if m.text_work else "")
                       + (f"+ ZeRO-3 working set {_gib(m.fsdp_work)} " if m.fsdp_work else "")
                       + f"= {_gib(m.total)}"
                       + (f" (peak: step or start-up {_gib(floor[m.rank])})"
                          if floor[m.rank] > m.total else "")
                       + _fits(peaks[m.rank], budget))
        if budget is not None:
            out.append(headroom_line(budget, peaks))
        z = estimate_zero3(config, counts, topo.world_size, vision_tokens=vt,
                           text_tokens=text_tokens + lm_audio, settings=settings,
                           state_bytes=policy.state_bytes(), segment_tokens=seg)
        if audio is not None:
            z += audio_activation_bytes(config.audio_config, 1, audio_seconds, settings)
        unit = "GPU" if gpu else "rank"
        out.append(f"  (reference: ZeRO-3 over {topo.world_size} {unit}s, one sample per {unit}, "
                   f"no SP/TP: {_gib(z)} per {unit}{_fits(z, budget)})")
    return "\n".join(out)


def _audio_samples(rf, topology):
    """Clips one audio replica encodes per micro-batch (None without an audio group)."""
    a = topology.encoder("audio")
    mb = rf.optim.global_batch_size // rf.optim.micro_batches
    return None if a is None else max(1, -(-mb // a.dp))


def _stages(topology, sep: str) -> str:
    """``vision 1, audio 0, text 1``: every module's ZeRO stage."""
    return sep.join(f"{m.name} {m.zero_stage}" for m in topology.modules)


def _ranks_text(ranks: list) -> str:
    return ", ".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}-{ranks[-1]}"


def _labels_lines(rf, topo) -> list:
    """Which nodes each placement group's workers run on (placement.labels), or nothing."""
    from ray_dhp.train.labels import group_labels

    if not rf.placement.labels:
        return []
    return ["node labels (placement.labels; Ray Train's per-worker label_selector):"] + [
        f"  ranks {g.ranks[0]}-{g.ranks[-1]} [{'+'.join(g.names)}]: "
        + (", ".join(f"{k}={v}" for k, v in sel.items()) or "any node")
        for g, sel in group_labels(topo, rf.placement.labels)]


def nodes_text(rf, *, nodes: int, gpus_per_node: int, vision_tokens: int, text_tokens: int,
               attention: str = "flash",
               internode_bw: float = 45e9, audio_seconds: float = 30.0) -> str:
    """The node view of `ray-dhp plan --nodes N --gpus-per-node G`: which DHP ranks share a node
    (as the backend orders them, `ray_dhp.parallel.nodes.node_local_order`) and, per collective, the
    bytes one rank sends per optimizer step and whether its groups cross the node boundary."""
    from ray_dhp.cli.schema import ConfigError
    from ray_dhp.models.sizes import count_params
    from ray_dhp.planning.recommend import Layout, Workload
    from ray_dhp.parallel.nodes import node_local_order, nodes_by_rank
    from ray_dhp.planning.traffic import collective_bytes, collective_groups

    dhp = rf.dhp_config()
    topo, config = dhp.topology(), dhp.model_config()
    if nodes < 1 or gpus_per_node < 1:
        raise ConfigError(f"--nodes {nodes} --gpus-per-node {gpus_per_node}: both must be >= 1.")
    if topo.world_size > nodes * gpus_per_node:
        raise ConfigError(f"the layout needs {topo.world_size} workers but {nodes} node(s) x "
                          f"{gpus_per_node} GPU(s) hold {nodes * gpus_per_node}.")
    if topo.placement not in ("collocated", "disjoint"):
        raise ConfigError(f"--nodes: the cost model plans the collocated and disjoint placements "
                          f"only; placement.mode={dhp.placement!r} (a grouping) has no traffic "
                          "model yet. Plan it without --nodes (ranks, meshes, memory).")
    slots = [k for k in range(nodes) for _ in range(gpus_per_node)][:topo.world_size]
    node_of = nodes_by_rank(node_local_order(topo, slots), slots)
    a = topo.encoder("audio")
    layout = Layout(topo.placement, dhp.schedule, topo.vision.inner, topo.vision.dp,
                    topo.text.inner, topo.text.dp, vision_zero=topo.vision.zero_stage,
                    text_zero=topo.text.zero_stage, text_ep=topo.text_expert_parallel,
                    audio_dp=a.dp if a else 0, audio_zero=a.zero_stage if a else None,
                    text_cp=topo.text.cp)
    counts = count_params(config)
    audio = {}
    if a is not None:  # one clip per sample: its rows in the LM's sequence, the tower off the LM
        audio = dict(audio_seconds=audio_seconds, audio_params=count_audio(config))
        text_tokens, counts = text_tokens + lm_audio_tokens(config, audio_seconds), without_audio(counts)
    w = Workload(vision_tokens=vision_tokens, text_tokens=text_tokens,
                 global_batch_size=rf.optim.global_batch_size, micro_batches=rf.optim.micro_batches,
                 settings=settings_of(rf, attention),
                 state_bytes=float(policy_of_run(rf).state_bytes()), policy=policy_of_run(rf),
                 packing=packing_of(rf), **audio)
    volume = collective_bytes(config, counts, layout, w)
    groups = collective_groups(topo, w.micro_batch_size)
    out = ["", f"nodes: {nodes} x {gpus_per_node} GPUs; DHP ranks by node (Ray Train fills a node "
               "with consecutive ranks under the default PACK strategy; the backend permutes them "
               "only if that keeps more sp/tp groups inside a node):"]
    for k in sorted(set(node_of)):
        ranks = [r for r in range(len(node_of)) if node_of[r] == k]
        out.append(f"  node {k}: ranks {_ranks_text(ranks)}")
    out.append(f"collectives per optimizer step ({vision_tokens} vision + {text_tokens} text tokens"
               + (f" (with the audio rows), {audio_seconds:g} s of audio" if audio else "")
               + f" per sample, {w.micro_batches} micro-batch(es) of {w.micro_batch_size}): bytes "
               "one rank sends")
    crossing = 0.0
    for name, gs in groups.items():
        if not gs or volume[name] == 0:
            if (topo.text_expert_parallel > 1 or not name.startswith("text expert")) \
                    and (topo.text.cp > 1 or not name.startswith("text cp")):
                out.append(f"  {name:22s} none")
            continue
        spans = sorted({tuple(sorted({node_of[r] for r in g})) for g in gs if
                        len({node_of[r] for r in g}) > 1})
        where = ("CROSSES nodes " + ", ".join("|".join(map(str, s)) for s in spans)) if spans \
            else "inside a node"
        crossing += volume[name] if spans else 0.0
        out.append(f"  {name:22s} {_gib(volume[name])}  {where}")
    out.append(f"over the network per step: {_gib(crossing)} per rank at most "
               f"(~{crossing / internode_bw * 1e3:.3g} ms at {internode_bw / 1e9:g} GB/s per GPU)")
    return "\n".join(out)


def _cp_form(config, topo) -> str:
    """Which buffers CP's working set is: Ulysses' all-to-all, or the ring's (beyond the heads)."""
    from ray_dhp.planning.ring_cost import ring_form

    return "ring" if ring_form(config.text_config, topo.text.inner, topo.text.cp) else "all-to-all"
