"""Sweep the learning rate and the vision layout of the tiny demo with Ray Tune.

    python examples/tune_sweep.py [--steps 6] [--storage /tmp/ray_dhp_sweep]

Each trial is a whole DisaggregatedTrainer run on 2 workers; the two vision layouts use the same
workers differently (Ulysses SP=2, or 2 data-parallel replicas of the unsharded ViT), with text
TP=2 collocated in both, so they are one grid choice.
"""

import argparse
import os

from ray import tune

from ray_dhp.tune import sweep

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--storage", default="/tmp/ray_dhp_sweep")
    args = p.parse_args()
    grid = sweep(
        os.path.join(HERE, "tiny.yaml"),
        {
            "optim.lr": tune.grid_search([3e-4, 3e-3]),
            "vision": tune.grid_search([{"sequence_parallel": 2, "data_parallel": 1},
                                        {"sequence_parallel": 1, "data_parallel": 2}]),
        },
        overrides=[f"optim.num_steps={args.steps}", f"optim.log_every={args.steps}",
                   f"run.storage_path={args.storage}", "run.name=tiny_sweep"],
        metric="loss", mode="min",
    )
    for r in grid:
        print(f"lr={r.config['optim.lr']:g} vision={r.config['vision']}: "
              f"final loss {r.metrics['loss']:.4f}")
    best = grid.get_best_result()
    print(f"best: lr={best.config['optim.lr']:g} vision={best.config['vision']} "
          f"loss {best.metrics['loss']:.4f}")


if __name__ == "__main__":
    main()
