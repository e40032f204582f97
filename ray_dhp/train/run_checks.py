"""One check of a run before any worker starts: the loop's settings against the model, the
layout and each other (`check_run`).

Every entry point goes through it: `ray_dhp.run_file.RunFile.validate` (``ray-dhp plan``,
``config`` and ``train``) and `ray_dhp.train.trainer.DisaggregatedTrainer` (the Python API).
They differ only in how a key is named (the run file's path ``data.packing``, or
``train_loop_config.packing`` as the user wrote it) and in what each holds besides (a run file:
its worker count, dataset files, device and pools; the trainer: its ``datasets=``), which each
checks before calling this. The engine trusts what passed here.
"""

from __future__ import annotations

from typing import Callable, Optional


def check_run(dhp, loop, *, datasets, name: Callable[[str], str],
              score_attribute: Optional[str] = None,
              validation_key: str = 'datasets["validation"]',
              score_key: str = "run_config.checkpoint_config.checkpoint_score_attribute",
              processor_key: str = "DHPConfig(processor=...)",
              model_key: str = "DHPConfig(model=...)") -> list:
    """ConfigError (a ValueError) for the first contradiction, naming keys with ``name``:
    packing against the family, the evaluation settings
    against the datasets (``datasets``: the run's dataset names) and the checkpoint ranking
    (``score_attribute``), the processor's image area against the model's patch unit, the
    per-module choices against the layout, and the processor against the model (loaded in
    the driver). ``dhp``: the `ray_dhp.layout.DHPConfig`, its processor set; ``loop``: the
    `ray_dhp.config.train_loop.TrainLoopConfig`. Returns the processor's notes (said once, by
    the caller)."""
    from ray_dhp.config.tuning import check_layout, parse_tuning
    from ray_dhp.data.compat import check_run_processor
    from ray_dhp.data.pixels import check_run_pixels
    from ray_dhp.models import family_of
    from ray_dhp.step.evaluation import VALIDATION, check_eval_setup

    from ray_dhp.config.checks import ConfigError

    packing = loop.data.packing
    try:
        family_of(dhp.model_config()).check_packing(packing, name("data.packing"))
    except ValueError as e:  # the family's refusal, said as a configuration error
        raise ConfigError(str(e)) from None
    check_eval_setup(loop.data, loop.checkpoint, has_validation=VALIDATION in datasets, name=name,
                     score_attribute=score_attribute, validation_key=validation_key,
                     score_key=score_key)
    check_run_pixels(loop.processor.min_pixels, loop.processor.max_pixels, dhp, name)
    key = name("optim.modules")
    check_layout(parse_tuning(loop.optim.modules, key=key), dhp.text.sequence_parallel is True,
                 key=key)
    return check_run_processor(dhp, processor_key=processor_key, model_key=model_key)
