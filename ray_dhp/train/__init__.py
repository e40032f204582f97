"""The Ray Train integration: `DisaggregatedTrainer`, the backend that builds the DHP groups on
every worker, the default train loop and its `TrainLoopConfig`, callbacks, tracking, Tune
sweeps, driver-side cluster checks and the no-Ray launcher.
"""
