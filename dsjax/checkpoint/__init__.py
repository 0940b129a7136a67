"""Checkpoint I/O: safetensors (HF layout), name tables, validation."""

from dsjax.checkpoint.loader import load_checkpoint
from dsjax.checkpoint.safetensors_io import CheckpointError, CheckpointFiles, SafetensorsFile, write_safetensors

__all__ = ["CheckpointError", "CheckpointFiles", "SafetensorsFile", "load_checkpoint", "write_safetensors"]
