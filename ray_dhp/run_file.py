"""The run file of ``ray-dhp``: one typed configuration that maps 1:1 to YAML.

Sections are thin dataclasses that build the library's own objects; fields that already exist
there (`ModuleParallel`, `DHPConfig`, `TrainLoopConfig`) are borrowed, not repeated, so defaults
and help strings have one source. ``ray-dhp config --print-defaults`` prints every key.

Example:
    >>> from ray_dhp.run_file import load_run_file
    >>> rf = load_run_file("examples/tiny.yaml", ["optim.lr=3e-4", "vision.sequence_parallel=2"])
    >>> rf.dhp_config().num_workers  # doctest: +SKIP
    2

Relative paths (``model.path``, ``data.train``, ``data.datasets``, ``run.storage_path``...) are resolved against the
current directory when the file is loaded (Ray workers change directory).
"""

from __future__ import annotations

import os
import time
from dataclasses import asdict, dataclass, fields, make_dataclass
from typing import Optional

from ray_dhp.cli.schema import (ConfigError, apply_overrides, borrow, from_dict, option,
                                section)
from ray_dhp.layout import FURTHER_ENCODERS, DHPConfig, ModuleParallel
from ray_dhp.config.train_loop import TrainLoopConfig, check_dataset_weights

__all__ = ["RunFile", "ConfigError", "load_run_file", "run_file_from_dict", "loop_key_in_file",
           "SHORTHANDS"]

_DATA_KEYS = ("data_root", "max_tokens", "packing", "bad_data", "dataset_weights", "prefetch",
              "data_workers", "max_text_chars", "max_image_pixels", "max_bad_fraction",
              "eval_every", "eval_batch_size", "index_dir", "video_fps", "video_min_frames",
              "video_max_frames", "video_min_pixels", "video_max_pixels", "video_total_pixels")
_CHECKPOINT_KEYS = tuple(k for k in ("checkpoint_every", "async_save", "resume_from")
                         if k in {f.name for f in fields(TrainLoopConfig)})
_TRACKING_KEYS = ("tensorboard", "mlflow", "wandb", "ray_report_logs")
_PROCESSOR_KEYS = ("system_prompt", "min_pixels", "max_pixels")
_NOT_IN_FILE = ("dataset_paths",)  # filled in from data.train and data.datasets


def _optim_keys() -> list:
    """Every TrainLoopConfig field not claimed by another section (new fields land here)."""
    taken = set(_DATA_KEYS + _CHECKPOINT_KEYS + _TRACKING_KEYS + _PROCESSOR_KEYS + _NOT_IN_FILE)
    return [f.name for f in fields(TrainLoopConfig) if f.name not in taken]


@dataclass
class ModelSection:
    """Which model to train: one of ``demo``, ``path``, ``family`` + ``preset``, or ``config``."""

    demo: Optional[str] = option("qwen2_5_vl", "tiny random-init demo model of this family "
                                 "(qwen2_5_vl, qwen2_vl, qwen3_vl, qwen3_vl_moe, qwen3_5, "
                                 "qwen3_5_moe, internvl, qwen2_5_omni); used when "
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
class _ProcessorOwn:
    path: Optional[str] = option(None, "local processor directory or Hub model id (default: the "
                                 "model directory, or the demo processor for a demo model)")


ProcessorSection = make_dataclass(
    "ProcessorSection", borrow(_ProcessorOwn, ["path"]) + borrow(TrainLoopConfig, _PROCESSOR_KEYS),
    namespace={"__doc__": "The processor (tokenizer + image processor; the prompt is rendered "
                          "with its chat template).", "__module__": __name__})


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
    + borrow(ModuleParallel, ["data_parallel", "zero_stage", "optimizer_offload", "expert_parallel",
                              "expert_tensor_parallel"]),
    namespace={"__doc__": "Degrees of the text group (the language model takes tensor "
                          "parallelism, optionally with Megatron sequence parallelism).",
               "__module__": __name__})

PlacementSection = make_dataclass(
    "PlacementSection", borrow(DHPConfig, ["mode", "schedule", "timeout_s", "node_local"],
                               rename={"mode": "placement"}),
    namespace={"__doc__": "Where the module groups run (`placement: disjoint` is short for "
                          "`placement: {mode: disjoint}`).", "__module__": __name__})


@dataclass
class _DataOwn:
    train: Optional[str] = option(None, "training annotations (LLaVA JSON/JSONL): the dataset "
                                  "named \"train\"")
    datasets: Optional[dict] = option(None, "more named annotation files, {name: path}, mixed "
                                      "with data.train by data.dataset_weights")
    validation: Optional[str] = option(None, "validation annotations (LLaVA JSON/JSONL): the "
                                       "dataset named \"validation\", evaluated (eval_loss over "
                                       "all of it) every data.eval_every steps and at the end")
    demo_samples: int = option(64, "when train is unset: generate the demo shapes set with this "
                               "many samples into <storage_path>/<run name>/demo_data", ge=1)


DataSection = make_dataclass(
    "DataSection", borrow(_DataOwn, ["train", "validation", "datasets", "demo_samples"]) + borrow(TrainLoopConfig, _DATA_KEYS),
    namespace={"__doc__": "Training data.", "__module__": __name__})

OptimSection = make_dataclass(
    "OptimSection", borrow(TrainLoopConfig, _optim_keys()),
    namespace={"__doc__": "Optimizer and loop hyper-parameters (TrainLoopConfig).",
               "__module__": __name__})


@dataclass
class _CheckpointOwn:
    num_to_keep: Optional[int] = option(None, "keep this many checkpoints, the latest or, with "
                                        "score_attribute, the best (null: all)", ge=1)
    score_attribute: Optional[str] = option(None, "rank checkpoints by this reported metric, "
                                            "e.g. eval_loss (needs data.validation; "
                                            "checkpoint_every a multiple of data.eval_every); "
                                            "null: by recency")
    score_order: str = option("min", "min or max: which score is best", choices=("min", "max"))


CheckpointSection = make_dataclass(
    "CheckpointSection", borrow(TrainLoopConfig, _CHECKPOINT_KEYS) + borrow(_CheckpointOwn, ["num_to_keep", "score_attribute", "score_order"]),
    namespace={"__doc__": "Checkpointing.", "__module__": __name__})


TrackingSection = make_dataclass(
    "TrackingSection", borrow(TrainLoopConfig, _TRACKING_KEYS),
    namespace={"__doc__": "Experiment tracking (TensorBoard, MLflow, W&B) and console output.",
               "__module__": __name__})


@dataclass
class ScalingSection:
    """Ray Train workers (ray.train.ScalingConfig)."""

    num_workers: Optional[int] = option(None, "Ray Train workers (null: derived from the layout; "
                                        "anything else must equal it)", ge=1)
    resources_per_worker: Optional[dict] = option(None, "e.g. {CPU: 1} (null: Ray's default, 1 "
                                                  "CPU, plus 1 GPU with use_gpu)", ge=0)
    use_gpu: bool = option(False, "one GPU per worker (NCCL); false: CPU and gloo")


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


@dataclass
class RunFile:
    """A whole ``ray-dhp`` run: model, layout, data, hyper-parameters, Ray resources."""

    model: ModelSection = section(ModelSection, "which model to train")
    processor: ProcessorSection = section(ProcessorSection, "tokenizer + image processor")
    vision: VisionSection = section(VisionSection, "degrees of the vision group "
                                    "(sequence_parallel, data_parallel)")
    text: TextSection = section(TextSection, "degrees of the text group "
                                "(tensor_parallel, data_parallel)")
    audio: Optional[AudioSection] = section(AudioSection, "degrees of the audio encoder's group "
                                            "(data_parallel, zero_stage); absent: no audio group",
                                            optional=True)
    placement: PlacementSection = section(PlacementSection, "where the module groups run",
                                          shorthand="mode")
    data: DataSection = section(DataSection, "training data")
    optim: OptimSection = section(OptimSection, "optimizer and loop hyper-parameters")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpointing")
    tracking: TrackingSection = section(TrackingSection, "experiment tracking and console")
    scaling: ScalingSection = section(ScalingSection, "Ray Train workers")
    run: RunSection = section(RunSection, "the Ray Train run")

    # -- building the library's objects -------------------------------------------------------

    def model_spec(self):
        """A transformers config (demo, preset, inline) or an absolute local directory."""
        from ray_dhp.cli.models import build_model_spec

        return build_model_spec(self.model)

    def processor_spec(self):
        """A processor object (demo), a local directory, or None (load from the model dir)."""
        if self.processor.path:
            from ray_dhp.models.hub import resolve_model_path

            try:  # a local directory or a Hub id in the Hugging Face cache
                return resolve_model_path(self.processor.path, "processor.path")
            except ValueError as e:
                raise ConfigError(str(e)) from None
        m = self.model
        if not (m.path or m.preset or m.config) and m.demo:
            from ray_dhp import demo

            return demo.tiny_processor(m.demo)
        return None

    def dhp_config(self, with_processor: bool = True) -> DHPConfig:
        """The layout (validated against the model's dims; no weights are loaded)."""
        try:
            return DHPConfig(model=self.model_spec(),
                             processor=self.processor_spec() if with_processor else None,
                             vision=ModuleParallel(**asdict(self.vision)),
                             text=ModuleParallel(**asdict(self.text)),
                             **{name: ModuleParallel(**asdict(getattr(self, name)))
                                for name in FURTHER_ENCODERS if getattr(self, name) is not None},
                             placement=self.placement.mode, schedule=self.placement.schedule,
                             timeout_s=self.placement.timeout_s,
                             node_local=self.placement.node_local)
        except ConfigError:
            raise
        except ValueError as e:
            raise ConfigError(str(e)) from None

    def train_loop_config(self) -> dict:
        """``train_loop_config`` of the built-in loop (validated as a TrainLoopConfig; errors
        name the run-file keys)."""
        d = {**asdict(self.optim), **{k: getattr(self.data, k) for k in _DATA_KEYS},
             **{k: getattr(self.checkpoint, k) for k in _CHECKPOINT_KEYS},
             **{k: getattr(self.tracking, k) for k in _TRACKING_KEYS},
             **{k: getattr(self.processor, k) for k in _PROCESSOR_KEYS}}
        if d.get("data_root"):
            d["data_root"] = os.path.abspath(os.path.expanduser(d["data_root"]))
        try:
            TrainLoopConfig(**d)
        except ConfigError as e:
            raise e.renamed(loop_key_in_file) from None
        return d

    def dataset_names(self) -> list:
        """The named datasets of the run ("train" is data.train, or the demo set when neither
        data.train nor data.datasets is set), checked against data.dataset_weights."""
        extra = self.data.datasets or {}
        if self.data.validation and "validation" in extra:
            raise ConfigError('data.datasets.validation: the dataset "validation" is '
                              'data.validation; set one of them.')
        if self.data.train and "train" in extra:
            raise ConfigError('data.datasets.train: the dataset "train" is data.train; set one '
                              'of them.')
        names = (["train"] if self.data.train or not extra else []) + list(extra)
        names += ["validation"] if self.data.validation else []
        extra = {k: v for k, v in extra.items() if k != "validation"}
        if self.data.dataset_weights is None and extra:
            raise ConfigError(f"data.datasets: {sorted(extra)} need data.dataset_weights "
                              "({name: weight}) to be mixed into training.")
        check_dataset_weights(self.data.dataset_weights, names, key="data.dataset_weights")
        return names

    def validate(self) -> "RunFile":
        """Every check that needs neither Ray, nor weights, nor the data files: the keys' values
        (also checked as the file is read), the layout against the model's dimensions, the
        worker count, the loop's hyper-parameters and the datasets' weights. ``ray-dhp plan``,
        ``config`` and ``train`` all go through here; errors name the run-file key."""
        dhp = self.dhp_config(with_processor=False)
        self.num_workers(dhp)
        raw = self.train_loop_config()
        loop = TrainLoopConfig(**raw)
        from ray_dhp.models import family_of

        family_of(dhp.model_config()).check_packing(loop.packing, "data.packing")
        names = self.dataset_names()
        from ray_dhp.step.evaluation import check_eval_setup

        check_eval_setup(loop, has_validation="validation" in names,
                         score_attribute=self.checkpoint.score_attribute, name=loop_key_in_file,
                         validation_key="data.validation", score_key="checkpoint.score_attribute")
        from ray_dhp.data.pixels import check_run_pixels

        pixels = (self.processor.min_pixels, self.processor.max_pixels)
        if pixels != (None, None):  # against the model's patch unit and the processor's limits
            check_run_pixels(*pixels, self.dhp_config(), loop_key_in_file)
        from ray_dhp.config.tuning import check_layout, parse_tuning

        check_layout(parse_tuning(raw.get("modules"), key=loop_key_in_file("modules")),
                     dhp.text.sequence_parallel is True, key=loop_key_in_file("modules"))
        self.data_paths()
        from ray_dhp.data.compat import check_run_processor

        dhp.processor = self.processor_spec()  # processor.path must exist; fits the model
        check_run_processor(dhp, processor_key="processor.path", model_key="model.path")
        return self

    def data_paths(self) -> dict:
        """``{dataset name: path}`` of data.train / data.datasets / data.validation, each
        checked to exist (ConfigError naming the key); data.train unset: the demo set, "train"
        then absent here (`ray_dhp.cli.train.prepare_data` generates it)."""
        paths = {**({"train": self.data.train} if self.data.train else {}),
                 **(self.data.datasets or {}),
                 **({"validation": self.data.validation} if self.data.validation else {})}
        own = {"train": "data.train", "validation": "data.validation"}
        for name, path in paths.items():
            if not isinstance(path, str) or not os.path.exists(path):
                raise ConfigError(f"{own.get(name, f'data.datasets.{name}')}: {path} does not exist.")
        return paths

    def run_name(self) -> str:
        if not self.run.name:
            self.run.name = time.strftime("ray_dhp_%Y%m%d_%H%M%S")
        return self.run.name

    def storage_path(self) -> str:
        return os.path.abspath(os.path.expanduser(self.run.storage_path or "~/ray_results"))

    def num_workers(self, dhp: Optional[DHPConfig] = None) -> int:
        dhp = dhp or self.dhp_config()
        n = self.scaling.num_workers
        if n is not None:
            try:
                dhp.validate_workers(n)
            except ValueError as e:
                raise ConfigError(f"scaling.num_workers: {e}") from None
            return n
        return dhp.num_workers

    def to_dict(self) -> dict:
        """Plain YAML-able dict (tuples become lists)."""
        return _plain(asdict(self))


def _plain(x):
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


SHORTHANDS = {"placement": "mode"}


def loop_key_in_file(name: str) -> str:
    """The run-file key of a `TrainLoopConfig` field (``lr`` -> ``optim.lr``)."""
    if name in _DATA_KEYS:
        return f"data.{name}"
    if name in _CHECKPOINT_KEYS:
        return f"checkpoint.{name}"
    if name in _PROCESSOR_KEYS:
        return f"processor.{name}"
    if name == "dataset_paths":
        return "data.train/data.datasets"
    return f"optim.{name}"


def run_file_from_dict(data: dict, overrides=()) -> RunFile:
    """A validated `RunFile` from a raw dict plus ``key=value`` overrides (ConfigError on
    mistakes, naming the key; see `RunFile.validate`)."""
    rf = from_dict(RunFile, apply_overrides(data, overrides, SHORTHANDS))
    for sec, key in (("model", "path"), ("data", "train"), ("data", "validation"), ("run", "storage_path"),
                     ("checkpoint", "resume_from")):
        obj = getattr(rf, sec)
        if hasattr(obj, key):
            fix = _model_location if (sec, key) == ("model", "path") else _absolute
            setattr(obj, key, fix(getattr(obj, key)))
    if rf.data.datasets:
        rf.data.datasets = {k: _absolute(v) for k, v in rf.data.datasets.items()}
    return rf.validate()


def _model_location(value):
    """``model.path``: a Hub model id (org/name that is no local path) as is, else `_absolute`."""
    from ray_dhp.models.hub import looks_like_repo_id

    if isinstance(value, str) and looks_like_repo_id(value) and not os.path.exists(value):
        return value
    return _absolute(value)


def _absolute(value):
    """A local path made absolute (Ray workers change directory); URIs and non-strings as is."""
    if isinstance(value, str) and value and "://" not in value:
        return os.path.abspath(os.path.expanduser(value))
    return value


def load_run_file(path: Optional[str], overrides=()) -> RunFile:
    """Read a YAML run file (None: the defaults) and apply ``key=value`` overrides."""
    import yaml

    data = {}
    if path is not None:
        if not os.path.isfile(path):
            raise ConfigError(f"{path}: no such run file.")
        with open(path) as f:
            try:
                data = yaml.safe_load(f) or {}
            except yaml.YAMLError as e:
                raise ConfigError(f"{path}: not valid YAML: {e}") from None
    return run_file_from_dict(data, overrides)
