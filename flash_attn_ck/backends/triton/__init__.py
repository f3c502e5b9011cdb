"""The Triton backend for CUDA GPUs (tuned on the H200, sm_90): see backend.py and docs/triton.md."""

from .backend import TritonBackend

BACKEND = TritonBackend

__all__ = ["BACKEND", "TritonBackend"]
