"""Imported first by the forkserver of `ray_dhp.train.launch.spawn` (``start_method="forkserver"``):
one thread per math library while the server imports, so that it runs no threads when it forks
its ranks (numpy's OpenBLAS starts its pool at import). Each rank gets the caller's environment
back and sets its own torch threads; nothing else imports this module."""

import os

for _name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_name] = "1"
