"""The prepared GPU run (see run_gpu.sh)."""
