"""Sharded checkpoints that load at any layout, their integrity checks, and export to a Hugging
Face model directory.
"""
