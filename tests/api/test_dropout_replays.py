"""The dropout replay check of dropout_replays.py (a fresh pattern per run, the same one in forward and backward) on
the CPU reference backend, without capture: the oracle that tests/gpu/test_cuda_graphs.py holds CUDA graph replays to,
checked where no GPU is available."""

from __future__ import annotations

import pytest
import torch

from dropout_replays import check_dropout_replays


@pytest.mark.parametrize("path", ["autograd", "low_level"])
def test_dropout_checks_on_cpu(path):
    """The dropout oracle on the CPU reference backend, without capture."""
    check_dropout_replays(path, "cpu", torch.float32, "reference", tol=1e-5)
