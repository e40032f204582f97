"""The bottom floor: plain dataclasses and their validation (what each key accepts, the default
loop's sections and their tree `TrainLoopConfig`, the per-module tuning choices). Imports nothing
else from ray_dhp."""
