"""The one-launch Triton kernels: the forward, one program per query tile, and the backward, one launch of key-tile
and dQ-pass programs. Their mask rule is scores.py's, written once."""
