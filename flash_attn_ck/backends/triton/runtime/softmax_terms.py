"""Terms of the scores and of a row's online softmax that both kernel families compute alike: ALiBi's distance
(`alibi_distance`) and a learnable sink as the softmax's last term (`take_sink`, docs/semantics.md §Learnable sinks).
(The softcap's tanh differs: one_launch/scores.accurate_tanh, which the interpreter runs, and the GPU's own in the
Gluon kernels, gluon_common.hardware_tanh.)
The one-launch kernels (one_launch/) and the warp-specialised ones (gluon/) call the same helpers (in runtime/, which
both families may import): their `tl` operations are elementwise, so they build the same IR on a Gluon
kernel's tensors as on a Triton kernel's."""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def alibi_distance(rows, cols, shift):
    """ALiBi's |i + shift - j| in fp32 for query rows `rows` and key columns `cols` (broadcast elementwise); the
    scores lose slope times it. `shift` puts the distance's zero on the bottom-right diagonal whatever the mask's
    alignment (docs/semantics.md)."""
    return tl.abs(rows + shift - cols).to(tl.float32)


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
