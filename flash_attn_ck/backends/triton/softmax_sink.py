"""The learnable sink as the last term of a row's online softmax (docs/semantics.md §Learnable sinks): one helper that
the one-launch forward (one_launch/forward.py) and the warp-specialised forward (gluon/fwd_ws.py) both call; its
`tl` operations are elementwise, so they build the same IR on a Gluon kernel's tensors as on a Triton kernel's."""

import triton
import triton.language as tl


@triton.jit
def take_sink(m_i, l_i, sink):
    """The running max and sum of a row's softmax over its keys (log2 units) with the sink's logit `sink` (log2 units)
    taken in as one more term, and the factor that moves the keys' terms to the new max. A row without keys gets
    l = 1 and max = sink (out 0, lse = sink); with a sink of -inf it stays empty; a sink of +inf takes the whole row
    (out 0, lse +inf)."""
    m_new = tl.maximum(m_i, sink)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)      # no key and a sink of -inf: nothing at all
    alpha = tl.exp2(m_i - m_safe)
    sink_term = tl.where(sink == float("inf"), 1.0, tl.exp2(sink - m_safe))
    return m_new, l_i * alpha + sink_term, alpha
