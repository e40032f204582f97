"""The model-state peak of the optimizer step, per rank: what `ray-dhp plan` prints as
``step peak`` and what the engine's step reaches (measured by ``tests/distributed/test_step_peak.py``
on CPU and by ``benchmarks/gpu/precision_check.py`` with CUDA's allocator counters).

During the step a rank holds its `RankState` (weights, gradients, masters, AdamW moments) plus:

* ``bf16_mixed``: nothing for the gradients accumulated in fp32 (they become the masters'
  gradients as they are); for FSDP2's bf16 gradient shards (stage 3, ``state.upcast``
  elements) the fp32 master gradients of one chunk (`ray_dhp.step.precision.MasterWeights.step`
  upcasts, steps and drops them chunk by chunk of ``CHUNK_BYTES``, freeing each bf16 gradient as
  it is upcast: +2 B per element of the chunk);
* ``bf16``: one parameter's gradient rounded to bf16 at a time (+2 B per element of the largest
  tensor, its fp32 sum freed right after);
* AdamW's temporaries: none for the fused CUDA kernel (``fused=True``, the engine's choice on
  CUDA); the single-tensor loop (CPU) makes two moment-sized temporaries of one parameter
  (``sqrt(exp_avg_sq)`` and its quotient) at a time.
"""

from __future__ import annotations

from typing import Optional


def step_peak(state, policy, largest: int, reduced: int = 0, replicated: int = 0,
              chunk_bytes: Optional[int] = None, bucket_bytes: Optional[int] = None,
              fused_adamw: bool = True) -> int:
    """Peak bytes of a rank's optimizer step: its ``state`` (a `ray_dhp.planning.memory.RankState`)
    plus the larger transient of its two phases: the gradient all-reduce (`MAX_IN_FLIGHT` flat
    buckets in the reduce dtype; ``reduced``: elements this rank all-reduces over replicas), while the
    gradients DTensor hands back whole for a TP-sharded weight (the vocab-parallel embedding's,
    ``replicated``: the elements beyond this rank's shard; sliced by
    `ray_dhp.parallel.data_parallel.ensure_grads`) are still held, and the update (above). ``largest``:
    element count of the largest tensor the rank updates."""
    from ray_dhp.parallel.data_parallel import _BUCKET_BYTES
    from ray_dhp.step.precision import CHUNK_BYTES

    from ray_dhp.parallel.zero import MAX_IN_FLIGHT

    per_bucket = (_BUCKET_BYTES if bucket_bytes is None else bucket_bytes) // policy.grad_bytes()
    bucket = min(reduced, MAX_IN_FLIGHT * per_bucket)  # the buckets reducing at once
    reduce_peak = state.device_total + bucket * _size(policy.reduce_dtype) + replicated * policy.grad_bytes()
    return max(reduce_peak, _update_peak(state, policy, largest, chunk_bytes, fused_adamw))


def _size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


def _update_peak(state, policy, largest, chunk_bytes, fused_adamw) -> int:
    if not state.updated:
        return state.device_total
    from ray_dhp.step.precision import CHUNK_BYTES

    moment = 4 if policy.master else policy.optimizer_bytes() // 2
    temps = 0 if fused_adamw else 2 * moment * largest
    if not policy.master:
        rounded = policy.weight_bytes() * largest if policy.grad_dtype != policy.param_dtype else 0
        return state.device_total + temps + rounded
    chunk = min(state.upcast, max(largest, (CHUNK_BYTES if chunk_bytes is None else chunk_bytes) // 4))
    return state.device_total + (4 - policy.weight_bytes()) * chunk + temps


def rank_step_peak(state, policy, counts, topology, rank: int, text_config,
                   extra_reduced: int = 0) -> int:
    """`step_peak` of ``rank`` as `ray-dhp plan` prints it (GPU: fused AdamW): the ViT is
    all-reduced over the vision group, the text model over its DP replicas; under TP the
    vocab-parallel embedding's gradient comes back whole. ``largest`` is the largest parameter
    unsharded (an upper bound where TP splits it). ``extra_reduced``: elements of a further
    module the rank all-reduces (an audio tower over its replicas)."""
    roles = topology.roles(rank)
    tp = topology.text.inner
    v = topology.vision  # at stage 3 FSDP2 reduce-scatters the ViT in its backward: no buckets
    reduced = counts.vision if "vision" in roles and v.size > 1 and v.zero_stage != 3 else 0
    reduced += extra_reduced
    if "text" in roles and topology.text.dp > 1:
        reduced += counts.text_per_rank(tp)
    emb = text_config.vocab_size * text_config.hidden_size
    replicated = emb - emb // tp if "text" in roles and tp > 1 else 0
    return step_peak(state, policy, counts.largest, reduced, replicated)


def rank_floor(counts, audio, topology, rank: int, policy, text_config) -> int:
    """The larger of ``rank``'s step peak (`rank_step_peak`) and start-up peak: what the rank
    reaches with no activations alive, the floor of its planned peak. ``counts``: the whole
    model's `ray_dhp.models.sizes.ParamCounts` (its audio tower, if any, leaves the text ranks
    when the topology has an audio group); ``audio``: the tower's `AudioCounts` or None."""
    from ray_dhp.planning.memory_audio import module_rank_state, without_audio

    st = module_rank_state(counts, audio, topology, rank, policy)
    ag = topology.encoder("audio")
    hosts = audio is not None and ag is not None and "audio" in topology.roles(rank)
    reduced = audio.params if hosts and ag.size > 1 else 0
    base = without_audio(counts) if audio is not None and ag is not None else counts
    return max(rank_step_peak(st, policy, base, topology, rank, text_config, reduced),
               st.startup_peak)
