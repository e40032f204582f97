"""Train loops the Ray end-to-end tests hand to `DisaggregatedTrainer` (shared by several test
files; everything the workers run is defined inside the returned ``loop``, so it is pickled by
value: Ray workers cannot import the tests)."""

from __future__ import annotations

import os


def fp64_loop(fault=None, pause=None):
    """The built-in loop, its engine built in fp64 (test-only: the loop has no dtype option; fp64
    is what makes comparisons with the single-process engine exact to ~1e-16).

    ``fault``: rank ``fault["rank"]`` SIGKILLs itself at ``(fault["event"], fault["step"])`` once
    per run (the marker file ``fault["marker"]`` remembers it), and rank 0 logs every attempt to
    ``fault["attempts"]``. ``pause``: at ``("step_end", pause["step"])`` every rank touches
    ``pause["paused"]`` (+ its rank) and waits until the file ``pause["go"]`` exists, so a test
    can act on the machine while the run is alive mid-training."""

    def loop(config):
        import signal
        import time

        import ray.train
        import torch

        from ray_dhp.step import engine
        from ray_dhp.train.loop import train_loop

        base = getattr(engine.DHPEngine, "fp32_base", engine.DHPEngine)

        class DHPEngine64(base):
            fp32_base = base

            def __init__(self, *args, **kwargs):
                super().__init__(*args, dtype=torch.float64, **kwargs)

        engine.DHPEngine = DHPEngine64  # train_loop imports it from the module at call time
        rank = ray.train.get_context().get_world_rank()
        if fault is not None and rank == 0:
            with open(fault["attempts"], "a") as f:
                f.write("attempt\n")

        def hook(event, step):
            if fault is not None and (rank, event, step) == (
                    fault["rank"], fault["event"], fault["step"]) \
                    and not os.path.exists(fault["marker"]):
                open(fault["marker"], "w").close()
                os.kill(os.getpid(), signal.SIGKILL)
            if pause is not None and (event, step) == ("step_end", pause["step"]):
                open(f"{pause['paused']}.{rank}", "w").close()
                while not os.path.exists(pause["go"]):
                    time.sleep(0.2)

        return train_loop(config, hook=hook)

    return loop
