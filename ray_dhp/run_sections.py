"""The sections of the run file (`ray_dhp.run_file.RunFile`): one dataclass per YAML section.

The default loop's sections are the loop's own dataclasses (`ray_dhp.config.sections`,
`ray_dhp.config.data_section`): ``optim`` and ``tracking`` as they are; ``processor``, ``data``
and ``checkpoint`` subclass them with the keys only a run file has (``processor.path``,
``data.train``, ``checkpoint.num_to_keep``...). The layout's sections borrow `ModuleParallel` and
`DHPConfig` fields, so defaults and help strings have one source."""

from __future__ import annotations

from dataclasses import dataclass, make_dataclass
from typing import Optional

from ray_dhp.cli.schema import borrow, option
from ray_dhp.config.data_section import DataConfig
from ray_dhp.config.sections import CheckpointConfig, ProcessorConfig
from ray_dhp.layout import DHPConfig, ModuleParallel
from ray_dhp.planning.devices import ACCELERATORS

__all__ = ["ModelSection", "ProcessorSection", "VisionSection", "AudioSection", "TextSection",
           "PlacementSection", "DataSection", "CheckpointSection", "ScalingSection",
           "HardwareSection", "RunSection"]


@dataclass
class ModelSection:
    """Which model to train: one of ``demo``, ``path``, ``family`` + ``preset``, or ``config``."""

    demo: Optional[str] = option("qwen2_5_vl", "tiny random-init demo model of this family "
                                 "(qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, "
                                 "qwen3_5_moe, internvl, internvl3_5 (InternVL with a Qwen3 LM), "
                                 "qwen2_5_omni, qwen3_omni_moe, or any generic "
                                 "model type of docs/supported_models.md, e.g. gemma3); used when "
                                 "path, preset and config are unset")
    path: Optional[str] = option(None, "local Hugging Face model directory, or a Hub model id "
                                 "(org/name, e.g. Qwen/Qwen2.5-VL-7B-Instruct) found in the "
                                 "Hugging Face cache (HF_HUB_CACHE), downloaded once if the Hub "
                                 "is reachable")
    family: Optional[str] = option(None, "model family of preset/config (e.g. qwen2_5_vl)")
    preset: Optional[str] = option(None, "published dims of the family without weights (e.g. "
                                   "32b); random init, or for `ray-dhp plan`")
    config: Optional[dict] = option(None, "inline transformers config (vision_config, "
                                    "text_config, ...); merged over the preset if both are given")


@dataclass
class ProcessorSection(ProcessorConfig):
    """The processor (tokenizer + image processor; the prompt is rendered with its chat
    template)."""

    path: Optional[str] = option(None, "local processor directory or Hub model id (default: the "
                                 "model directory, or the demo processor for a demo model)")


@dataclass
class _SequenceParallelOwn:
    vision: int = option(1, "Ulysses degree: each image's patches are split over this many "
                         "workers; the vision attention heads must divide by it", ge=1)
    text: bool = option(False, "Megatron sequence parallelism over the tensor_parallel ranks: "
                        "every text activation kept for backward (norms, residuals, projection "
                        "inputs, checkpointed block inputs) holds 1/tensor_parallel of the "
                        "sequence; turn it on for long images (no extra workers; needs "
                        "tensor_parallel > 1)")


VisionSection = make_dataclass(
    "VisionSection", borrow(_SequenceParallelOwn, ["sequence_parallel"],
                             rename={"sequence_parallel": "vision"})
    + borrow(ModuleParallel, ["data_parallel", "zero_stage", "optimizer_offload"]),
    namespace={"__doc__": "Degrees of the vision group (the vision encoder takes Ulysses sequence "
                          "parallelism, not tensor parallelism).", "__module__": __name__})

@dataclass
class _AudioOwn:
    sequence_parallel: int = option(1, "sequence parallelism of the audio encoder: 1 (the audio "
                                    "encoder trains data parallel only for now)", ge=1)


AudioSection = make_dataclass(
    "AudioSection", borrow(_AudioOwn, ["sequence_parallel"])
    + borrow(ModuleParallel, ["data_parallel", "zero_stage", "optimizer_offload"]),
    namespace={"__doc__": "Degrees of the audio encoder's group, for a model with an audio "
                          "encoder (Qwen2.5-Omni's thinker); absent: the model trains without an "
                          "audio group (docs/multi_encoder.md).", "__module__": __name__})

TextSection = make_dataclass(
    "TextSection", borrow(ModuleParallel, ["tensor_parallel"])
    + borrow(_SequenceParallelOwn, ["sequence_parallel"], rename={"sequence_parallel": "text"})
    + borrow(ModuleParallel, ["data_parallel", "context_parallel", "zero_stage", "optimizer_offload",
                              "expert_parallel", "expert_tensor_parallel"]),
    namespace={"__doc__": "Degrees of the text group (the language model takes tensor "
                          "parallelism, optionally with Megatron sequence parallelism).",
               "__module__": __name__})

PlacementSection = make_dataclass(
    "PlacementSection", borrow(DHPConfig, ["mode", "labels", "schedule", "timeout_s", "node_local"],
                               rename={"mode": "placement"}),
    namespace={"__doc__": "Where the module groups run (`placement: disjoint` is short for "
                          "`placement: {mode: disjoint}`).", "__module__": __name__})


@dataclass
class DataSection(DataConfig):
    """Training data."""

    train: Optional[str] = option(None, "training annotations (LLaVA JSON/JSONL): the dataset "
                                  "named \"train\"")
    datasets: Optional[dict] = option(None, "more named annotation files, {name: path}, mixed "
                                      "with data.train by data.dataset_weights")
    validation: Optional[str] = option(None, "validation annotations (LLaVA JSON/JSONL): the "
                                       "dataset named \"validation\", evaluated (eval_loss over "
                                       "all of it) every data.eval_every steps and at the end")
    demo_samples: int = option(64, "when train is unset: generate the demo shapes set with this "
                               "many samples into <storage_path>/<run name>/demo_data", ge=1)


@dataclass
class CheckpointSection(CheckpointConfig):
    """Checkpointing."""

    num_to_keep: Optional[int] = option(None, "keep this many checkpoints, the latest or, with "
                                        "score_attribute, the best (null: all)", ge=1)
    score_attribute: Optional[str] = option(None, "rank checkpoints by this reported metric, "
                                            "e.g. eval_loss (needs data.validation; "
                                            "checkpoint_every a multiple of data.eval_every); "
                                            "null: by recency")
    score_order: str = option("min", "min or max: which score is best", choices=("min", "max"))


@dataclass
class ScalingSection:
    """Ray Train workers (ray.train.ScalingConfig)."""

    num_workers: Optional[int] = option(None, "Ray Train workers (null: derived from the layout; "
                                        "anything else must equal it)", ge=1)
    resources_per_worker: Optional[dict] = option(None, "e.g. {CPU: 1} (null: Ray's default, 1 "
                                                  "CPU, plus 1 GPU with use_gpu)", ge=0)
    use_gpu: bool = option(False, "one GPU per worker (NCCL); false: CPU and gloo")
    accelerator: Optional[str] = option(None, "the GPU kind `ray-dhp plan` checks memory "
                                        "against (its memory per device and default margin: "
                                        "ray_dhp/planning/devices.py); null: h100 with "
                                        "use_gpu. Planning only: Ray's placement is not "
                                        "constrained by it", choices=tuple(ACCELERATORS))
    device_margin_gib: Optional[float] = option(None, "GiB per device a plan keeps free for the "
                                                "CUDA context, communicator buffers and "
                                                "allocator fragmentation (null: the "
                                                "accelerator's default)", ge=0)


@dataclass
class HardwareSection:
    """Pools of accelerators `ray-dhp plan --recommend` places the module groups on, in the shape
    of a ``--pool`` file (ray_dhp/planning/pools.py; docs/placement.md)."""

    pools: Optional[dict] = option(None, "{name: {accelerator, devices_per_node, nodes, "
                                   "price_per_device_hour, labels, memory_gib, "
                                   "peak_bf16_tflops, link_gbs, internode_gbs, hbm_tbs, "
                                   "margin_gib, efficiency}}: nodes of one accelerator type each "
                                   "(accelerator: a row of ray_dhp/planning/devices.py or of "
                                   "hardware.accelerators)")
    accelerators: Optional[dict] = option(None, "your own accelerator kinds, {name: "
                                          "{memory_gib, peak_bf16_tflops, link_gbs, "
                                          "internode_gbs, hbm_tbs}}")


@dataclass
class RunSection:
    """The Ray Train run (ray.train.RunConfig) and the local Ray instance."""

    name: Optional[str] = option(None, "run name, the folder under storage_path (null: "
                                 "ray_dhp_<date>_<time>). Reusing the name of an unfinished run "
                                 "resumes it; a finished run is refused (raise optim.num_steps "
                                 "to continue it)")
    storage_path: Optional[str] = option(None, "where results and checkpoints go (null: "
                                         "~/ray_results); must be shared storage on multi-node "
                                         "clusters")
    max_failures: int = option(0, "worker-group restarts allowed over the run (-1: unlimited)",
                               ge=-1)
    placement_timeout_s: Optional[float] = option(600.0, "give up (a clear error) after waiting "
                                                  "this long in total for room to place the "
                                                  "workers, e.g. after losing a node that is not "
                                                  "replaced (null: wait forever, Ray's default)")
    num_cpus: Optional[int] = option(None, "logical CPUs of the local Ray that `ray-dhp train` "
                                     "starts when there is no cluster to join (neither "
                                     "RAY_ADDRESS nor one started with `ray start` on this "
                                     "machine; null: enough for the workers); ignored when "
                                     "joining a cluster", ge=1)
    ray_address: Optional[str] = option(None, "which Ray `ray-dhp train` uses: null = join the "
                                        "cluster of RAY_ADDRESS or of `ray start` on this "
                                        "machine, else start a local one; \"local\" = always "
                                        "a private local Ray (beside any cluster on the "
                                        "machine); \"auto\" or host:port = join that cluster "
                                        "(RAY_ADDRESS, when set, still wins, as in ray.init)")
