"""One training step: the engine (`DHPEngine`) and its plain-data micro-batch plan, schedules,
optimizer, precision policies, and the single-process reference.
"""
