"""The warp-specialised Gluon kernels for sm_90: fwd_ws, bwd_ws and bwd_ws_split. Their mask rule is
gluon_common.Mask, written once."""
