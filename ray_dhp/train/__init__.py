"""The Ray Train integration: `DisaggregatedTrainer`, the backend that builds the DHP groups on
every worker, the default train loop, callbacks, tracking, driver-side cluster checks and the
no-Ray launcher (the loop's `TrainLoopConfig`: `ray_dhp.config.train_loop`; Tune sweeps:
`ray_dhp.tune`).
"""
