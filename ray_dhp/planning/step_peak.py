"""The model-state peak of the optimizer step, per rank: what `ray-dhp plan` prints as
``step peak`` and what the engine's step reaches (measured by ``tests/distributed/test_step_peak.py``
on CPU and by ``benchmarks/gpu/precision_check.py`` with CUDA's allocator counters).

During the step a rank holds its `RankState` (weights, gradients, masters, AdamW moments; at
ZeRO stages 1-2 the update starts by freeing the gradients another replica updates,
``RankState.released``, and the largest tensor it steps is the largest it owns) plus:

* ``bf16_mixed``: nothing for the gradients accumulated in fp32 (they become the masters'
  gradients as they are); for FSDP2's bf16 gradient shards (stage 3, ``state.upcast``
  elements) the fp32 master gradients of one chunk (`ray_dhp.step.precision.MasterWeights.step`
  upcasts, steps and drops them chunk by chunk of ``CHUNK_BYTES``, freeing each bf16 gradient as
  it is upcast: +2 B per element of the chunk);
* ``bf16``: one parameter's gradient rounded to bf16 at a time (+2 B per element of the largest
  tensor, its fp32 sum freed right after);
* AdamW's temporaries: none for the fused CUDA kernel (``fused=True``, the engine's choice on
  CUDA for a module of plain tensors, `ray_dhp.step.optim.adamw_impl`); the single-tensor loop
  (CPU) makes two moment-sized temporaries of one parameter (``sqrt(exp_avg_sq)`` and its
  quotient) at a time; the **foreach** kernels (CUDA, a module with DTensor parameters: text
  TP or EP, any module at ZeRO stage 3) make one moment-sized temporary (``_foreach_sqrt`` of
  the second moments, then divided and shifted in place) for *every* tensor of the parameter
  group they step at once. Without masters that is the module's whole decayed group on the
  rank (counted as all it updates, an upper bound by its norms and biases); with masters
  (``bf16_mixed``) `MasterWeights.step` hands AdamW one chunk at a time, so at most
  ``max(CHUNK_BYTES / 4, largest)`` elements; a module offloaded to the host steps there
  (none on the device). Modules step one after another: the largest of them counts.
  Measured on CPU with ``foreach=True`` (``tests/unit/test_foreach_temporaries.py``: the live
  bytes of the step over the state equal this); CPU cannot show CUDA's caching allocator
  rounding the temporaries' blocks, nor DTensor's dispatch (the local tensors' kernels are the
  same).
"""

from __future__ import annotations

import dataclasses
from typing import Optional


def step_peak(state, policy, largest: int, reduced: int = 0, replicated: int = 0,
              chunk_bytes: Optional[int] = None, bucket_bytes: Optional[int] = None,
              fused_adamw: bool = True, foreach: int = 0) -> int:
    """Peak bytes of a rank's optimizer step: its ``state`` (a `ray_dhp.planning.memory.RankState`)
    plus the larger transient of its two phases: the gradient all-reduce (`MAX_IN_FLIGHT` flat
    buckets in the reduce dtype; ``reduced``: elements this rank all-reduces over replicas), while the
    gradients DTensor hands back whole for a TP-sharded weight (the vocab-parallel embedding's,
    ``replicated``: all its elements, held whole while `ray_dhp.parallel.data_parallel.ensure_grads`
    copies this rank's shard out of it, the shard being the state's gradient) are still held,
    and the update (above). ``largest``:
    element count of the largest tensor the rank updates; ``foreach``: elements the foreach
    AdamW steps at once on the device (`foreach_elements`), one moment-sized temporary each."""
    from ray_dhp.parallel.data_parallel import _BUCKET_BYTES
    from ray_dhp.parallel.zero import MAX_IN_FLIGHT

    per_bucket = (_BUCKET_BYTES if bucket_bytes is None else bucket_bytes) // policy.grad_bytes()
    bucket = min(reduced, MAX_IN_FLIGHT * per_bucket)  # the buckets reducing at once
    reduce_peak = state.device_total + bucket * _size(policy.reduce_dtype) + replicated * policy.grad_bytes()
    return max(reduce_peak, _update_peak(state, policy, largest, chunk_bytes, fused_adamw, foreach))


def _size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _update_peak(state, policy, largest, chunk_bytes, fused_adamw, foreach=0) -> int:
    if not state.updated:
        return state.device_total - state.released
    from ray_dhp.step.precision import CHUNK_BYTES

    state = dataclasses.replace(state, grads=state.grads - state.released)  # ZeRO 1-2's freed

    moment = 4 if policy.master else policy.optimizer_bytes() // 2
    temps = max(0 if fused_adamw else 2 * moment * largest, moment * foreach)
    if not policy.master:
        rounded = policy.weight_bytes() * largest if policy.grad_dtype != policy.param_dtype else 0
        return state.device_total + temps + rounded
    chunk = min(state.upcast, max(largest, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // 4))
    return state.device_total + (4 - policy.weight_bytes()) * chunk + temps


def foreach_elements(policy, counts, topology, rank: int, text_updated: int,
                     chunk_bytes: Optional[int] = None) -> int:
    """Elements CUDA's foreach AdamW steps at once on ``rank`` (module docstring): per module
    whose parameters are DTensors (text under TP or EP, any module at ZeRO stage 3) and whose
    optimizer runs on the device, what it updates (``text_updated`` for the text module), in
    chunks under masters; the largest module's."""
    from ray_dhp.step.precision import CHUNK_BYTES

    out = 0
    chunk = (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // 4
    for m in topology.modules:
        if not m.hosts(rank) or m.offload:
            continue
        text = m is topology.text
        dtensors = m.zero_stage == 3 or (text and (m.inner > 1 or topology.text_expert_parallel > 1))
        if not dtensors:
            continue
        if text:
            n = text_updated
        elif m is topology.vision:
            n = counts.vision_updated_by(rank - m.offset, m.size, m.zero_stage)
        else:
            continue  # further encoders: ZeRO 0-2, plain tensors (fused)
        out = max(out, min(n, max(chunk, largest_local(counts, topology, text, rank))) if policy.master
                  else n)
    return out


def largest_local(counts, topology, text: bool, rank: Optional[int] = None) -> int:
    """Elements of the largest local tensor of the text module (``text``) or the ViT on a rank:
    its TP shard, 1/ep of an experts tensor, its FSDP2 share at ZeRO stage 3; with ``rank``, at
    ZeRO stage 1-2 the largest of the tensors that rank owns (updates: the partition gives the
    largest tensors out first, one to each replica)."""
    from ray_dhp.models.sizes import owned_largest

    if not text:
        v = topology.vision
        if v.zero_stage == 3 and counts.vision_params:
            return max(q.fsdp_share(0, v.size, 1) for q in counts.vision_params)
        if rank is not None and v.zero_stage and v.size > 1 and counts.vision_sizes:
            return owned_largest(list(counts.vision_sizes), rank - v.offset, v.size)
        return max((q.numel for q in counts.vision_params), default=counts.largest)
    t, ep = topology.text, topology.text_expert_parallel
    if (rank is not None and t.zero_stage in (1, 2) and t.dp * t.cp > 1 and ep == 1
            and counts.text_sizes):
        return owned_largest([q.local(t.inner) for q in counts.text_sizes if q.trained],
                             t.grad_index(rank), t.dp * t.cp)
    sizes = []
    for q in counts.text_sizes:
        if q.expert and ep > 1:
            sizes.append(q.local(t.inner) // ep)
        elif t.zero_stage == 3:
            sizes.append(q.fsdp_share(0, t.dp, t.inner))
        else:
            sizes.append(q.local(t.inner))
    return max(sizes, default=counts.largest)


def rank_step_peak(state, policy, counts, topology, rank: int, text_config,
                   extra_reduced: int = 0, extra_updated: int = 0, cpu: bool = False) -> int:
    """`step_peak` of ``rank`` as `ray-dhp plan` prints it (GPU: fused or foreach AdamW,
    `foreach_elements`; ``cpu``: CPU's single-tensor AdamW loop instead, what
    ``benchmarks/plan_accuracy.py`` measures; ``extra_updated``: elements a further module on the rank updates,
    an audio tower's, left out of the text module's): the ViT is
    all-reduced over the vision group, the text model over its DP replicas; under TP the
    vocab-parallel embedding's gradient comes back whole; a module at ZeRO stage 3 has none
    (FSDP2 reduce-scatters it in its backward). ``largest``: the largest local tensor of the
    modules the rank hosts (`largest_local`; a further module's unsharded). ``extra_reduced``:
    elements of a further module the rank all-reduces (an audio tower over its replicas)."""
    tp = topology.text.inner
    v = topology.vision  # at stage 3 FSDP2 reduce-scatters the ViT in its backward: no buckets
    tg = topology.text  # its gradient replicas: dp x cp
    on_v, on_t = v.hosts(rank), tg.hosts(rank)
    # the trained parameters' gradients (the frozen have none: a video tower an image run leaves)
    reduced = counts.vision - counts.vision_frozen if on_v and v.size > 1 and v.zero_stage != 3 else 0
    reduced += extra_reduced
    if on_t and tg.dp * tg.cp > 1 and tg.zero_stage != 3:
        reduced += counts.text_per_rank(tp) - counts.text_frozen_per_rank(tp)
        ep = topology.text_expert_parallel
        if ep > 1:  # the rank's 1/ep of the experts reduce over the dp / ep replicas holding them
            experts = sum(q.numel for q in counts.text_sizes if q.expert)
            reduced -= experts - (experts // ep if tg.dp // ep > 1 else 0)
    emb = text_config.vocab_size * text_config.hidden_size
    replicated = emb if on_t and tp > 1 else 0  # the whole gradient beside its shard's copy
    v_up = counts.vision_updated_by(rank - v.offset, v.size, v.zero_stage) if on_v else 0
    t_up = state.updated - v_up - extra_updated if on_t else 0
    sizes = [largest_local(counts, topology, m is tg, rank) for m in (v, tg) if m.hosts(rank)]
    largest = max(sizes + ([counts.largest] if extra_updated or not sizes else []))
    if cpu:
        return step_peak(state, policy, largest, reduced, replicated, fused_adamw=False)
    return step_peak(state, policy, largest, reduced, replicated,
                     foreach=foreach_elements(policy, counts, topology, rank, t_up))


def rank_floor(counts, audio, topology, rank: int, policy, text_config,
               micro_batches: int = 1) -> int:
    """The larger of ``rank``'s step peak (`rank_step_peak`) and start-up peak: what the rank
    reaches with no activations alive, the floor of its planned peak. ``counts``: the whole
    model's `ray_dhp.models.sizes.ParamCounts` (its audio tower, if any, leaves the text ranks
    when the topology has an audio group); ``audio``: the tower's `AudioCounts` or None."""
    from ray_dhp.planning.memory_audio import module_rank_state, without_audio

    st = module_rank_state(counts, audio, topology, rank, policy, micro_batches)
    ag = topology.encoder("audio")
    hosts = audio is not None and ag is not None and ag.hosts(rank)
    reduced = audio.params if hosts and ag.size > 1 else 0
    base = without_audio(counts) if audio is not None and ag is not None else counts
    a_up = audio_updated(audio, topology, rank, policy) if hosts else 0
    return max(rank_step_peak(st, policy, base, topology, rank, text_config, reduced, a_up),
               st.startup_peak)


def audio_updated(audio, topology, rank: int, policy) -> int:
    """Elements of the audio tower ``rank`` updates (its ZeRO partition)."""
    from ray_dhp.planning.memory_audio import audio_rank_state

    return audio_rank_state(audio, topology.encoder("audio"), rank, policy).updated
