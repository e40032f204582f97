"""The run file of ``ray-dhp``: one typed configuration that maps 1:1 to YAML.

The default loop's sections (``optim``, ``data``, ``processor``, ``checkpoint``, ``tracking``)
are the sections of its `TrainLoopConfig` (`ray_dhp.config.sections`), extended where a file has
more keys (`ray_dhp.run_sections`); the layout's sections borrow `ModuleParallel` and `DHPConfig`
fields. Defaults and help strings have one source. ``ray-dhp config --print-defaults`` prints
every key.

Example:
    >>> from ray_dhp.run_file import load_run_file
    >>> rf = load_run_file("examples/tiny.yaml", ["optim.lr=3e-4", "vision.sequence_parallel=2"])
    >>> rf.dhp_config().num_workers  # doctest: +SKIP
    2

Relative paths (``model.path``, ``data.train``, ``data.datasets``, ``run.storage_path``...) are resolved against the
current directory when the file is loaded (Ray workers change directory).
"""

from __future__ import annotations

import logging
import os
import re
import time
from dataclasses import asdict, dataclass, fields, is_dataclass
from typing import Optional

from ray_dhp.cli.schema import ConfigError, apply_overrides, file_fields, from_dict, section
from ray_dhp.config.data_section import check_dataset_weights
from ray_dhp.config.sections import OptimConfig, PrecisionConfig, TrackingConfig
from ray_dhp.config.train_loop import FLAT_KEYS, TrainLoopConfig
from ray_dhp.layout import FURTHER_ENCODERS, DHPConfig, ModuleParallel
from ray_dhp.run_sections import (AudioSection, CheckpointSection, DataSection, HardwareSection,
                                  ModelSection, PlacementSection, ProcessorSection, RunSection,
                                  ScalingSection, TextSection, VisionSection)

logger = logging.getLogger(__name__)

__all__ = ["RunFile", "ConfigError", "load_run_file", "run_file_from_dict", "loop_key_in_file",
           "SHORTHANDS"]


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
    optim: OptimConfig = section(OptimConfig, "optimizer and loop hyper-parameters")
    precision: PrecisionConfig = section(PrecisionConfig, "precision policy and TF32",
                                         shorthand="policy")
    checkpoint: CheckpointSection = section(CheckpointSection, "checkpointing")
    tracking: TrackingConfig = section(TrackingConfig, "experiment tracking and console")
    scaling: ScalingSection = section(ScalingSection, "Ray Train workers")
    hardware: Optional[HardwareSection] = section(
        HardwareSection, "pools of accelerators `ray-dhp plan --recommend` places the module "
        "groups on (the shape of a --pool file); absent: one accelerator kind", optional=True)
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
        if not (m.path or m.preset or m.config is not None) and m.demo:
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
                             placement=self.placement.mode, labels=self.placement.labels,
                             schedule=self.placement.schedule,
                             timeout_s=self.placement.timeout_s,
                             node_local=self.placement.node_local)
        except ConfigError:
            raise
        except ValueError as e:  # DHPConfig's ``labels`` key is placement.labels here
            raise ConfigError(re.sub(r"(?<![\w.])labels\.", "placement.labels.", str(e))) from None

    def loop_config(self) -> TrainLoopConfig:
        """The built-in loop's configuration: the loop's part of each of its sections, validated
        (errors name the run-file keys)."""
        parts = {}
        for f in fields(TrainLoopConfig):
            cls, mine = f.metadata["section"], getattr(self, f.name)
            parts[f.name] = cls(**{k.name: getattr(mine, k.name) for k in fields(cls)})
        try:
            return TrainLoopConfig(**parts)
        except ConfigError as e:
            raise e.renamed(loop_key_in_file) from None

    def train_loop_config(self) -> dict:
        """``train_loop_config`` of the built-in loop: `loop_config` as nested dicts."""
        return self.loop_config().to_dict()

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
        worker count, the loop's hyper-parameters and the datasets' weights, then the run's
        settings against each other (`ray_dhp.train.run_checks.check_run`, which the Python API's
        trainer calls too). ``ray-dhp plan``, ``config`` and ``train`` all go through here;
        errors name the run-file key."""
        dhp = self.dhp_config(with_processor=False)
        self.num_workers(dhp)
        loop = self.loop_config()
        names = self.dataset_names()
        self.data_paths()
        self.check_device()
        self.pools()
        from ray_dhp.train.run_checks import check_run

        dhp.processor = self.processor_spec()  # processor.path must exist
        for note in check_run(dhp, loop, datasets=names, name=loop_key_in_file,
                              score_attribute=self.checkpoint.score_attribute,
                              validation_key="data.validation",
                              score_key="checkpoint.score_attribute",
                              processor_key="processor.path", model_key="model.path"):
            logger.warning(note)  # said once, as the file is loaded
        return self

    def check_device(self) -> None:
        """``scaling.accelerator`` only with ``use_gpu``; ``scaling.device_margin_gib`` below the
        device's memory (ConfigError naming the key)."""
        sc = self.scaling
        if sc.accelerator is not None and not sc.use_gpu:
            raise ConfigError(f"scaling.accelerator={sc.accelerator} plans for a GPU but "
                              "scaling.use_gpu is false; set use_gpu: true or drop accelerator.")
        if sc.device_margin_gib is not None:
            from ray_dhp.planning.devices import budget_of

            try:
                budget_of(sc.accelerator, margin_gib=sc.device_margin_gib,
                          margin_key="scaling.device_margin_gib")
            except ValueError as e:
                raise ConfigError(str(e)) from None

    def pools(self):
        """The `ray_dhp.planning.pools.Pool` s of the ``hardware:`` section (None without one);
        ConfigError naming the ``hardware.`` key at fault."""
        if self.hardware is None:
            return None
        from ray_dhp.planning.pools import parse_pools

        data = {k: v for k, v in asdict(self.hardware).items() if v is not None}
        try:
            return parse_pools(data, key="hardware")
        except ValueError as e:
            raise ConfigError(str(e)) from None

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
        """Plain YAML-able dict of the file's keys (tuples become lists)."""
        return _plain(self)


def _plain(x):
    if is_dataclass(x):
        return {f.name: _plain(getattr(x, f.name)) for f in file_fields(x)}
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


# the sections a scalar may stand for (``placement: disjoint``, ``precision: bf16``): {section: field}
SHORTHANDS = {f.name: f.metadata["shorthand"] for f in fields(RunFile) if f.metadata.get("shorthand")}


def loop_key_in_file(key: str) -> str:
    """The run-file key of a loop key: its path in the tree (``optim.lr``), also for the Python
    API's flat name (``lr``, `ray_dhp.config.train_loop.FLAT_KEYS`)."""
    path = FLAT_KEYS.get(key, key)
    return "data.train/data.datasets" if path == "data.dataset_paths" else path


def run_file_from_dict(data: dict, overrides=()) -> RunFile:
    """A validated `RunFile` from a raw dict plus ``key=value`` overrides (ConfigError on
    mistakes, naming the key; see `RunFile.validate`)."""
    rf = from_dict(RunFile, apply_overrides(data, overrides, SHORTHANDS))
    for sec, key in (("model", "path"), ("data", "train"), ("data", "validation"), ("run", "storage_path"),
                     ("checkpoint", "resume_from"), ("data", "data_root")):
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
