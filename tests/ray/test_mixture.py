"""Two annotation files in different folders, mixed by dataset_weights, trained end to end."""

import ray.train

from ray_dhp import DHPConfig, DisaggregatedTrainer, demo


def test_two_weighted_path_datasets_train_and_report(ray_start, fast_reports, tmp_path):
    # "more" is larger than "shapes": its images 004-007 exist only in its own folder, so a wrong
    # per-dataset root would show up as extra skipped samples
    shapes = demo.make_dataset(tmp_path / "shapes", num_samples=4, seed=1,
                               bad_lines=[(2, "missing_image")])
    more = demo.make_dataset(tmp_path / "more", num_samples=8, seed=2,
                             bad_lines=[(5, "malformed_json")])
    dhp = DHPConfig(model=demo.tiny_model_config(), processor=demo.tiny_processor())
    result = DisaggregatedTrainer(
        train_loop_config=dict(lr=3e-3, global_batch_size=4, num_steps=3, log_every=3,
                               dataset_weights={"shapes": 1, "more": 2}),
        dhp_config=dhp,
        scaling_config=ray.train.ScalingConfig(num_workers=1, resources_per_worker={"CPU": 1}),
        run_config=ray.train.RunConfig(name="mix", storage_path=str(tmp_path / "runs")),
        datasets={"shapes": str(shapes), "more": str(more)},
    ).fit()
    m = result.metrics
    # 12 good samples take 14 draws: shapes 5 (4 + 1 into its 2nd epoch), more 9 (8 + 1)
    assert m["step"] == 3 and m["loss"] > 0
    assert m["skipped_samples"] == 2  # one bad line per dataset, each counted once
    assert m["epoch"] == 1  # both datasets finished their first pass
    assert m["dataset_draws"] == {"shapes": 5, "more": 9}  # 1:2 of 14 draws, to within one
    assert m["dataset_epochs"] == {"shapes": 1, "more": 1}
