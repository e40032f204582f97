"""User-facing configuration: `ModuleParallel` and `DHPConfig` (the backend config)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from ray.train.backend import BackendConfig

from ray_dhp.config.checks import check_fields, checked
from ray_dhp.parallel.zero import ZERO_STAGES
from ray_dhp.parallel.topology import EncoderDegrees, Topology, placement_groups

SCHEDULES = ("sequential", "pipelined")
NODE_LOCAL = ("warn", "strict")
# Encoder modules beyond the vision tower, each a `DHPConfig` keyword (and a run-file section) of
# its name, laid out after the vision encoder in this order; a family hosts encoder ``name`` when
# its `FamilySpec` has it (``FamilySpec.encoder_spec(name)``).
FURTHER_ENCODERS = ("audio",)


@dataclass
class ModuleParallel:
    """Parallel degrees of one module group.

    Args:
        sequence_parallel: vision: the Ulysses degree, each image's patches are split over this
            many workers (attention heads must divide by it). text: true/false, Megatron
            sequence parallelism over the tensor_parallel ranks (norms, residuals and
            checkpointed block inputs hold 1/tensor_parallel of the sequence; no extra workers).
        tensor_parallel: Megatron-style degree (language model only): attention heads, KV
            heads, MLP width and vocabulary are split over this many workers.
        data_parallel: replicas of the (sharded) module; each sees different samples.
        context_parallel: text only: each replica's sequence is split into this many
            contiguous slices, one per block of tensor_parallel workers (workers: tensor_parallel
            x context_parallel x data_parallel); around attention an all-to-all gives each
            worker the whole sequence for its share of the heads (Ulysses, where tensor_parallel
            x context_parallel divides the attention heads; beyond them ring attention: each
            worker keeps its queries and the keys and values pass around the CP ring). For
            sequences one TP group cannot hold (`ray_dhp.parallel.context`; docs/placement.md, "Context parallelism").
        zero_stage: how the module's state is split over the ranks that replicate it (text: its
            data_parallel ranks; an encoder (vision, audio): its whole group, whose SP ranks hold
            the tower too), as in DeepSpeed: 0 replicated; 1 fp32 masters and AdamW moments partitioned;
            2 also the reduced gradients (each reduced only to its owner); 3 also the weights
            (torch FSDP2 over the replicas; vision: over the whole vision group, composed with
            Ulysses SP). None: 1 where the module has more than one replica, else 0 (why:
            docs/concepts.md, "ZeRO stages").
        optimizer_offload: the module's optimizer masters and AdamW moments (of its ZeRO
            partition) live in host memory and the update runs on the CPU (DeepSpeedCPUAdam for
            fp32 masters, torch AdamW otherwise; DeepSpeed compiles its CPU op on first use, minutes);
            the device keeps weights and gradients. Needs plain (not DTensor) parameters:
            zero_stage < 3, and for text tensor_parallel=1.
        expert_parallel: text, mixture-of-experts models only: each sparse layer's experts are
            partitioned over this many data_parallel replicas (it must divide data_parallel and
            the number of experts); tokens reach their experts by all-to-all, expert gradients
            are summed over the replicas holding the same experts, and at zero_stage 1-2 the
            experts' masters and AdamW moments are split over the ranks holding them (those
            replicas and their TP ranks; `ray_dhp.parallel.expert`). With context_parallel the
            context-parallel ranks hold different tokens too: expert_parallel divides
            data_parallel x context_parallel and the EP group takes the CP ranks first.
        expert_tensor_parallel: text, mixture-of-experts models only: instead of replicating the
            experts on the tensor_parallel ranks, shard every expert's intermediate dimension
            over them like the dense MLP (needs tensor_parallel > 1, expert_parallel = 1; one
            all-gather and two all-reduces per sparse layer; `ray_dhp.parallel.expert_tp`).

    An encoder other than the vision tower (``DHPConfig(audio=...)``) takes the vision keys:
    ``data_parallel``, ``zero_stage``, ``optimizer_offload`` (the audio encoder: sequence_parallel
    1 and zero_stage 0-2 for now).

    Example:
        >>> ModuleParallel(sequence_parallel=2, data_parallel=2)  # 4 vision workers
    """

    sequence_parallel: Union[int, bool] = 1  # an int >= 1 (vision) or a bool (text): see __post_init__
    tensor_parallel: int = checked(1, ge=1)
    data_parallel: int = checked(1, ge=1)
    context_parallel: int = checked(1, ge=1)
    zero_stage: Optional[int] = checked(None, choices=(None,) + ZERO_STAGES)
    optimizer_offload: bool = False
    expert_parallel: int = checked(1, ge=1)
    expert_tensor_parallel: bool = False

    def __post_init__(self):
        for name in ("sequence_parallel", "tensor_parallel", "data_parallel", "expert_parallel",
                     "context_parallel"):
            v = getattr(self, name)
            if name == "sequence_parallel" and isinstance(v, bool):
                continue  # the text group's on/off switch (checked by DHPConfig)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"ModuleParallel.{name} must be an integer >= 1, got {v!r}.")
        if self.zero_stage is not None and (isinstance(self.zero_stage, bool)
                                            or self.zero_stage not in ZERO_STAGES):
            raise ValueError(f"ModuleParallel.zero_stage must be one of {ZERO_STAGES} (or None), "
                             f"got {self.zero_stage!r}.")
        if self.sequence_parallel > 1 and self.tensor_parallel > 1:
            raise ValueError(
                "ModuleParallel: use sequence_parallel for the vision module and tensor_parallel "
                "for the text module, not both in one module."
            )

    @property
    def sp_degree(self) -> int:
        """Workers per replica added by ``sequence_parallel`` (1 for the text on/off switch)."""
        return 1 if isinstance(self.sequence_parallel, bool) else self.sequence_parallel

    @property
    def size(self) -> int:
        return self.sp_degree * self.tensor_parallel * self.context_parallel * self.data_parallel


@dataclass
class DHPConfig(BackendConfig):
    """How the VLM is split over the Ray Train workers (the DisaggregatedBackend's config).

    Args:
        model: a ``transformers`` ``PretrainedConfig`` (random init from the seed), the path of a
            local Hugging Face model directory, or a Hub model id (``"Qwen/Qwen2.5-VL-7B-Instruct"``)
            found in the Hugging Face cache (downloaded once if the Hub is reachable; see
            `ray_dhp.models.hub`); resolved here, in the driver, to the directory workers load.
        processor: a ``transformers`` processor object (or a ``ray_dhp.data.VLProcessor``), a
            local directory or Hub id to load one from, or None to load it from ``model`` when
            that is a directory.
        vision: degrees of the vision group (``sequence_parallel``, ``data_parallel``).
        text: degrees of the text group (``tensor_parallel``, ``data_parallel``).
        audio: degrees of the audio encoder's group (``data_parallel``, ``zero_stage``,
            ``optimizer_offload``) for a model with an audio encoder (Qwen2.5-Omni's thinker);
            None (the default): the model trains without an audio group. Every further encoder
            (`FURTHER_ENCODERS`) is a keyword of its name like this one (docs/multi_encoder.md).
        placement: how the modules are grouped onto workers: ``"collocated"`` (every worker
            hosts a shard of every module), ``"disjoint"`` (each module on workers of its own:
            vision workers first, then audio, then text), or a list of placement groups, each a
            list of module names, every module in exactly one (``[["vision", "text"],
            ["audio"]]``: vision and text share workers, audio has its own); the modules of a
            group span all of its workers, so their degrees' products must be equal. Groups
            take consecutive ranks in the order of their first module.
        labels: node labels per module, ``{module: {label: value}}`` (e.g. ``{"vision":
            {"accel": "small"}, "text": {"accel": "big"}}``; Ray's selector syntax, ``"!spot"``,
            ``"in(a, b)"``): the workers of the placement group holding the module run only on
            nodes with these labels (Ray Train's per-worker ``label_selector``; modules of one
            group share theirs). A cluster without enough such nodes is refused before
            training, naming the label and the counts (docs/placement.md).
        schedule: ``"sequential"`` or ``"pipelined"`` micro-batch schedule between the groups
            (`ray_dhp.step.schedule`); None picks "pipelined" when there is more than one
            placement group, "sequential" for collocated. Results do not depend on it, only
            timing does.
        timeout_s: timeout of collective operations, in seconds.
        node_local: ``"warn"`` or ``"strict"``: what to do when the workers' nodes force a
            sequence/tensor-parallel group across a node boundary (the ranks are otherwise ordered
            so these groups stay inside a node): a warning in the driver, or an error (before
            workers start when the cluster's nodes cannot hold the groups; else when the group
            starts, which counts as a failed attempt for ``FailureConfig``).

    Example:
        >>> from ray_dhp import DHPConfig, ModuleParallel, demo
        >>> cfg = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor(),
        ...                 vision=ModuleParallel(sequence_parallel=2),
        ...                 text=ModuleParallel(tensor_parallel=2))
        >>> cfg.topology().world_size
        2
    """

    model: Any = None
    processor: Any = None
    vision: ModuleParallel = field(default_factory=ModuleParallel)
    text: ModuleParallel = field(default_factory=ModuleParallel)
    audio: Optional[ModuleParallel] = None
    placement: Union[str, list] = "collocated"  # a shorthand or a grouping: see __post_init__
    labels: Optional[dict] = None
    schedule: Optional[str] = checked(None, choices=(None,) + SCHEDULES)
    timeout_s: int = checked(1800, gt=0)
    node_local: str = checked("warn", choices=NODE_LOCAL)

    def __post_init__(self):
        if self.model is None:
            raise ValueError(
                "DHPConfig(model=...) is required: a transformers config (e.g. "
                "ray_dhp.demo.tiny_model_config()) or a local Hugging Face model directory."
            )
        if isinstance(self.model, (str, os.PathLike)):  # a directory or a Hub id (ray_dhp.models.hub)
            from ray_dhp.models.hub import resolve_model_path

            self.model = resolve_model_path(self.model, "DHPConfig(model=...)")
        if isinstance(self.processor, (str, os.PathLike)):
            from ray_dhp.models.hub import resolve_model_path

            self.processor = resolve_model_path(self.processor, "DHPConfig(processor=...)")
        for name in ("vision", "text"):
            if not isinstance(getattr(self, name), ModuleParallel):
                raise ValueError(f"DHPConfig.{name} must be a ModuleParallel, got {getattr(self, name)!r}.")
        for name in FURTHER_ENCODERS:
            if getattr(self, name) is not None and not isinstance(getattr(self, name), ModuleParallel):
                raise ValueError(f"DHPConfig.{name} must be a ModuleParallel or None, got "
                                 f"{getattr(self, name)!r}.")
        for name, m in self.encoder_parallel().items():
            _check_encoder(name, m)
        if not isinstance(self.text.sequence_parallel, bool) and self.text.sequence_parallel != 1:
            raise ValueError(
                f"DHPConfig.text.sequence_parallel={self.text.sequence_parallel!r}: for the text group it is "
                "true/false (Megatron sequence parallelism over the text tensor_parallel ranks), not a degree."
            )
        names = (*self.encoder_parallel(), "text")
        groups = placement_groups(self.placement, names)
        if not isinstance(self.placement, str):  # a grouping: the shorthand when it is one
            short = {"collocated": placement_groups("collocated", names),
                     "disjoint": placement_groups("disjoint", names)}
            self.placement = next((k for k, v in short.items() if v == groups),
                                  [list(g) for g in groups])
        from ray_dhp.train.labels import check_labels

        self.labels = check_labels(self.labels, names) or None
        if self.schedule is None:  # overlap the groups when they live on different workers
            self.schedule = "pipelined" if len(groups) > 1 else "sequential"
        if self.schedule not in SCHEDULES:
            raise ValueError(f"DHPConfig(schedule={self.schedule!r}): use one of {SCHEDULES}.")
        if self.node_local not in NODE_LOCAL:
            raise ValueError(f"DHPConfig(node_local={self.node_local!r}): use one of {NODE_LOCAL}.")
        check_fields(self, lambda k: f"DHPConfig.{k}")  # e.g. timeout_s > 0
        self.topology()  # validates the group sizes
        self.label_selectors()  # the modules of a group ask for the same labels
        self.validate_model()

    # -- derived -------------------------------------------------------------------------------

    def encoder_parallel(self) -> dict:
        """``{name: ModuleParallel}`` of every encoder module the model trains, in rank order:
        the vision tower, then each configured further encoder (`FURTHER_ENCODERS`)."""
        return {"vision": self.vision, **self._further_encoders()}

    def _further_encoders(self) -> dict:
        """``{name: ModuleParallel}`` of the configured encoders beyond the vision tower
        (`FURTHER_ENCODERS`), in rank order."""
        return {n: getattr(self, n) for n in FURTHER_ENCODERS if getattr(self, n) is not None}

    def topology(self) -> Topology:
        further = {n: EncoderDegrees(dp=m.data_parallel, sp=m.sequence_parallel, zero=m.zero_stage,
                                     offload=m.optimizer_offload)
                   for n, m in self._further_encoders().items()}
        return Topology.build(
            placement=self.placement,
            vision_dp=self.vision.data_parallel,
            vision_sp=self.vision.sequence_parallel,
            text_dp=self.text.data_parallel,
            text_tp=self.text.tensor_parallel,
            text_sequence_parallel=self.text.sequence_parallel is True,
            vision_zero=self.vision.zero_stage, text_zero=self.text.zero_stage,
            vision_offload=self.vision.optimizer_offload, text_offload=self.text.optimizer_offload,
            text_ep=self.text.expert_parallel,
            text_expert_tp=self.text.expert_tensor_parallel,
            encoders=further,
            text_cp=self.text.context_parallel,
        )

    def label_selectors(self) -> Optional[list]:
        """Ray Train's per-worker ``label_selector`` (one per DHP rank) from ``labels``; None
        without labels (`ray_dhp.train.labels`)."""
        from ray_dhp.train.labels import worker_label_selectors

        return worker_label_selectors(self.topology(), self.labels or {})

    @property
    def num_workers(self) -> int:
        """How many Ray Train workers this layout needs."""
        return self.topology().world_size

    def model_config(self):
        """The transformers config of the model (loaded from the directory if given as a path)."""
        from ray_dhp.models import load_model_config

        return load_model_config(self.model)

    def validate_model(self) -> None:
        """Check the degrees against the model's dimensions and the family's coverage
        (`ray_dhp.models.layout_fit.check_layout_fits`); raises ValueError saying what to change."""
        from ray_dhp.models import family_of
        from ray_dhp.models.layout_fit import check_layout_fits

        config = self.model_config()  # read once (a directory's config.json)
        check_layout_fits(family_of(config), config, self.topology())
        if isinstance(self.model, str):  # every shard there, shapes and dtypes as config.json says
            from ray_dhp.models.loading import check_model_directory

            check_model_directory(self.model)

    def validate_workers(self, num_workers: int) -> None:
        need = self.num_workers
        if num_workers != need:
            t = self.topology()
            how = " + ".join(" = ".join(f"{m.name} {m.dp}x{m.inner}" for m in g.modules)
                             if len(g.modules) > 1 else f"{g.names[0]} {g.size}"
                             for g in t.placement_groups())
            raise ValueError(
                f"ScalingConfig(num_workers={num_workers}) does not match the {t.placement} "
                f"layout, which needs {need} workers ({how}); set num_workers={need} or change "
                f"the {'/'.join(m.name for m in t.modules)} degrees."
            )

    # -- BackendConfig -------------------------------------------------------------------------

    @property
    def backend_cls(self):
        from ray_dhp.train.backend import DisaggregatedBackend

        return DisaggregatedBackend

    @property
    def train_func_context(self):
        from ray_dhp.train.backend import WorkerContextManager

        cfg = self

        def make():
            return WorkerContextManager(cfg)

        return make

    @property
    def framework(self):
        from ray.train.v2._internal.util import TrainingFramework

        return TrainingFramework.TORCH

    def to_dict(self) -> dict:
        return {
            **{name: vars(m) for name, m in self.encoder_parallel().items()},
            "text": vars(self.text),
            "placement": self.placement,
            **({"labels": self.labels} if self.labels else {}),
            "schedule": self.schedule,
            "model": self.model if isinstance(self.model, str) else type(self.model).__name__,
        }


ModelSpec = Union[str, Any]


def _check_encoder(name: str, m: ModuleParallel) -> None:
    """An encoder's degrees: Ulysses ``sequence_parallel`` (an integer), no tensor or expert
    parallelism; errors name the key ``<name>.<field>`` (what the encoder's family covers is
    checked with the model, `ray_dhp.models.layout_fit.check_encoders`)."""
    if m.tensor_parallel != 1:
        raise ValueError(f"{name}.tensor_parallel: the {name} group uses sequence_parallel and "
                         "data_parallel, not tensor_parallel; leave it at 1.")
    if isinstance(m.sequence_parallel, bool):
        raise ValueError(f"{name}.sequence_parallel is the Ulysses degree (an integer >= 1), "
                         f"got {m.sequence_parallel!r}.")
    if m.expert_parallel != 1:
        raise ValueError(f"{name}.expert_parallel: the {name} encoder has no experts; leave it at 1.")
    if m.context_parallel != 1:
        raise ValueError(f"{name}.context_parallel: context parallelism splits the language "
                         f"model's sequence; the {name} encoder uses sequence_parallel. Leave it at 1.")
    if m.expert_tensor_parallel:
        raise ValueError(f"{name}.expert_tensor_parallel: the {name} encoder has no experts; "
                         "leave it false.")
