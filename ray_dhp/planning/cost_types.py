"""The cost model's types (`ray_dhp.planning.cost_model`): what it prices, `Hardware` (compute
and links), `Workload` (what one optimizer step processes) and `Layout` (the parallel degrees
and placement), and what it returns, `PhaseTimes` (predicted seconds per phase on one rank)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ray_dhp.planning.memory import ActivationSettings
from ray_dhp.parallel.topology import Topology

__all__ = ["Hardware", "Workload", "Layout", "PhaseTimes"]


@dataclass(frozen=True)
class Hardware:
    """Accelerator and interconnect of the cost model.

    Args:
        peak_flops: dense matmul peak per device; None: 989e12 for 2-byte activations (H100/H200
            SXM bf16 tensor cores) and 67e12 for fp32 (their non-tensor-core fp32 peak, what
            PyTorch's default fp32 matmul precision uses).
        efficiency: achieved fraction of the peak (model FLOPs utilisation), both modules.
        link_bw: bytes/s per device and direction inside a node (NVLink 4: 450 GB/s raw, NCCL
            reaches ~360 GB/s bus bandwidth).
        internode_bw: bytes/s per device between nodes (one 400 Gb/s NIC per GPU, ~45 GB/s).
        latency_s: fixed cost of one collective.
        hbm_bw: device memory bandwidth (H100 SXM 3.35 TB/s; H200 4.8 TB/s), for the optimizer.
        gpus_per_node: consecutive world ranks per node.
    """

    peak_flops: Optional[float] = None
    efficiency: float = 0.4
    link_bw: float = 360e9
    internode_bw: float = 45e9
    latency_s: float = 10e-6
    hbm_bw: float = 3.35e12
    gpus_per_node: int = 8

    def flops(self, dtype_bytes: int) -> float:
        peak = self.peak_flops or (989e12 if dtype_bytes <= 2 else 67e12)
        return peak * self.efficiency


@dataclass(frozen=True)
class Workload:
    """What one optimizer step processes, and how state and activations are kept."""

    vision_tokens: int             # patch tokens per sample
    text_tokens: int               # text tokens per sample, without the image placeholders
    global_batch_size: int
    micro_batches: int = 1
    settings: ActivationSettings = field(default_factory=ActivationSettings)
    state_bytes: float = 16.0      # model-state bytes per parameter (see ray_dhp.planning.memory)
    device_gib: float = 80.0
    #: GiB of ``device_gib`` a layout must leave free (CUDA context, communicators,
    #: fragmentation: `ray_dhp.planning.devices`); 0: the whole device
    margin_gib: float = 0.0
    #: A resolution mix ``((patch tokens, fraction), ...)`` (fractions sum to 1) instead of one
    #: size; ``vision_tokens`` is then its largest (what memory plans for). See `replica_share`.
    vision_mix: Optional[tuple] = None
    policy: object = None          # a PrecisionPolicy: exact per-rank state (overrides state_bytes)
    #: Patch tokens per attention segment: a video's frame (`ray_dhp.planning.video.VideoShape`,
    #: ``vision_tokens`` = frames x this); None: each sample is one image (one segment).
    vision_segment: Optional[int] = None
    #: With an audio group (`Layout.audio_dp`): one clip of this many seconds per sample, and the
    #: audio tower's `ray_dhp.planning.memory_audio.AudioCounts` (``text_tokens`` then includes
    #: the clip's LLM tokens; `ray_dhp.planning.cost_audio`).
    audio_seconds: Optional[float] = None
    audio_params: object = None
    #: ``data.packing``: a `ray_dhp.planning.packing.Packing` (text activations and the linears'
    #: tokens are the packed rows', padded tail included; attention per sample); None: padded
    packing: object = None

    def __post_init__(self):
        if self.global_batch_size % self.micro_batches:
            raise ValueError(f"global_batch_size={self.global_batch_size} must be divisible by "
                             f"micro_batches={self.micro_batches}.")
        if self.vision_mix is not None:
            fr = [f for _, f in self.vision_mix]
            if not self.vision_mix or min(fr) <= 0 or abs(sum(fr) - 1) > 1e-6:
                raise ValueError(f"vision_mix={self.vision_mix}: fractions must be > 0 and sum to 1.")
            if max(v for v, _ in self.vision_mix) != self.vision_tokens:
                raise ValueError("vision_tokens must be the largest size of vision_mix.")
        if self.vision_segment is not None and (self.vision_mix is not None or self.vision_segment < 1
                                                or self.vision_tokens % self.vision_segment):
            raise ValueError(f"vision_segment={self.vision_segment}: a video's frame size must divide "
                             f"vision_tokens={self.vision_tokens} (and takes no vision_mix).")

    def mix(self) -> tuple:
        """``((patch tokens, fraction), ...)``: the mix, or the one size with fraction 1."""
        return self.vision_mix or ((self.vision_tokens, 1.0),)

    @property
    def micro_batch_size(self) -> int:
        return self.global_batch_size // self.micro_batches


@dataclass(frozen=True)
class Layout:
    """One candidate: placement, schedule and the degrees of both groups."""

    placement: str
    schedule: str
    vision_sp: int
    vision_dp: int
    text_tp: int
    text_dp: int
    text_sp: bool = False  # text sequence parallelism over the TP ranks (text_tp > 1)
    # ZeRO stages (`ray_dhp.parallel.zero`); None: the default (1 with more than one replica)
    vision_zero: Optional[int] = None
    text_zero: Optional[int] = None
    text_ep: int = 1  # expert parallelism over the text DP replicas (`ray_dhp.planning.experts`)
    audio_dp: int = 0  # replicas of the audio encoder's group (0: no audio group)
    audio_zero: Optional[int] = None
    text_cp: int = 1  # context parallelism: each text replica's sequence over text_cp x text_tp ranks

    def topology(self) -> Topology:
        from ray_dhp.parallel.topology import EncoderDegrees

        audio = {"audio": EncoderDegrees(dp=self.audio_dp, zero=self.audio_zero)} if self.audio_dp else None
        return Topology.build(placement=self.placement, vision_dp=self.vision_dp,
                              vision_sp=self.vision_sp, text_dp=self.text_dp, text_tp=self.text_tp,
                              text_sequence_parallel=self.text_sp,
                              vision_zero=self.vision_zero, text_zero=self.text_zero,
                              text_ep=self.text_ep, encoders=audio, text_cp=self.text_cp)

    @property
    def num_workers(self) -> int:
        return self.topology().world_size

    def describe(self) -> str:
        topo = self.topology()
        zero = ("" if self.vision_zero is None and self.text_zero is None
                and self.audio_zero is None else
                " (ZeRO " + " / ".join(f"{m.name} {m.zero_stage}" for m in topo.modules) + ")")
        return (f"{self.placement} {self.schedule}: vision sp{self.vision_sp}xdp{self.vision_dp}"
                + (f" + audio dp{self.audio_dp}" if self.audio_dp else "") + f" + text tp{self.text_tp}{'+sp' if self.text_sp else ''}"
                + (f"xcp{self.text_cp}" if self.text_cp > 1 else "") + f"xdp{self.text_dp}"
                f"{f' ep{self.text_ep}' if self.text_ep > 1 else ''}{zero}")

    def run_file_fragment(self) -> dict:
        """The run-file keys of this layout (``vision``, ``text``, ``placement``, ``scaling``)."""
        return {"vision": {"sequence_parallel": self.vision_sp, "data_parallel": self.vision_dp,
                           **({} if self.vision_zero is None else {"zero_stage": self.vision_zero})},
                **({"audio": {"data_parallel": self.audio_dp,
                              **({} if self.audio_zero is None else {"zero_stage": self.audio_zero})}}
                   if self.audio_dp else {}),
                "text": {"tensor_parallel": self.text_tp, "data_parallel": self.text_dp,
                         **({"sequence_parallel": True} if self.text_sp else {}),
                         **({} if self.text_zero is None else {"zero_stage": self.text_zero}),
                         **({"expert_parallel": self.text_ep} if self.text_ep > 1 else {}),
                         **({"context_parallel": self.text_cp} if self.text_cp > 1 else {})},
                "placement": {"mode": self.placement, "schedule": self.schedule},
                "scaling": {"num_workers": self.num_workers}}


@dataclass(frozen=True)
class PhaseTimes:
    """Predicted seconds on one rank: per micro-batch (``vision_fwd``, ``vision_bwd``, ``text``,
    ``boundary`` = one transfer) and per step (``vision_end``, ``text_end``: gradient reduction and
    optimizer). ``vision_comm`` / ``text_comm``: the Ulysses / TP part of the per-micro-batch
    times."""

    vision_fwd: float
    vision_bwd: float
    text: float
    boundary: float
    vision_end: float
    text_end: float
    vision_comm: float
    text_comm: float
    # the audio encoder's group (`ray_dhp.planning.cost_audio`; 0 without one)
    audio_fwd: float = 0.0
    audio_bwd: float = 0.0
    audio_boundary: float = 0.0
    audio_end: float = 0.0
