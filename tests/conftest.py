"""Suite-wide setup: with ``RAY_DHP_TEST_THREADS`` set, the pytest process (where the
single-process references run) uses that many torch threads too, like the spawned ranks
(tests/spawn.py). Unset, torch's default (``OMP_NUM_THREADS`` or the core count) is kept."""

import os

import torch

from tests.spawn import THREADS_ENV, rank_threads

if os.environ.get(THREADS_ENV):
    torch.set_num_threads(rank_threads())
