"""The main job runs end to end at a small size and reports errors, timings and the plan; a bad argument is one
line naming it, with argparse's exit status 2."""

from __future__ import annotations

import contextlib
import io
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import flash_attn_ck as fa
from flash_attn_ck.__main__ import main, parse_args
from flash_attn_ck.backends.reference import ReferenceBackend
from flash_attn_ck.core.checks import MAX_HEAD_DIM, MAX_INT64, MAX_WINDOW_SIDE

SETTINGS = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL = ["--device", "cpu", "--batch", "1", "--seqlen", "6", "--heads", "2", "--head-dim", "8", "--repeats", "1"]


def test_main_job_small(capsys):
    assert main(["--device", "cpu", "--batch", "1", "--seqlen", "96", "--seqlen-k", "130", "--heads", "4",
                 "--heads-k", "2", "--head-dim", "36", "--causal", "--deterministic", "--repeats", "1",
                 "--max-workspace-bytes", "200000"]) == 0
    text = capsys.readouterr().out
    assert "backend=reference" in text
    ratios = [float(r) for r in re.findall(r"^  \w+ +max.*ratio (\d+\.\d+)   bound \S+$", text, re.M)]
    assert len(ratios) == 4 and max(ratios) <= 2.0, text
    assert re.search(r"backward +\d+\.\d+ ms +\d+\.\d+ TFLOP/s", text)
    for buffer in ("softmax_d", "dq_accum", "q_padded"):
        assert buffer in text
    # Every backend chunks the backward under the 200000-byte cap (Triton's plan here: its padding buffers).
    units = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    size = r"(\d+(?:\.\d)?) (B|KiB|MiB|GiB)"
    plans = {name: (float(cap) * units[cu], float(whole) * units[wu], int(chunks), float(peak) * units[pu])
             for name, cap, cu, whole, wu, chunks, peak, pu in re.findall(
                 rf"backward workspace \((\w+)\): cap {size}; unchunked {size}; (\d+) chunk\(s\); peak {size}", text)}
    assert set(plans) == {"reference", "ck", "triton"}, text
    for name, (cap, unchunked, chunks, peak) in plans.items():
        assert abs(cap - 200000) <= 0.05 * 1024, (name, cap)
        assert peak <= cap < unchunked and chunks >= 2, (name, plans[name])
    assert re.search(r"dq_accum +float32 +2x1x", text)      # deterministic: 2 splits of 128 keys
    assert "  triton: " in text and "  ck: " in text


def _run(argv, parse_only=True) -> tuple[object, str]:
    """(parsed arguments or main's status, or the SystemExit code; stderr)."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            result = parse_args(argv) if parse_only else main(argv)
        except SystemExit as stop:
            result = stop.code
    return result, err.getvalue()


def _assert_one_line_error(status, stderr: str, argument: str) -> None:
    assert status == 2, (status, stderr)
    assert stderr.count("\n") == 1 and "Traceback" not in stderr, stderr
    assert re.match(rf"^python -m flash_attn_ck: error: .*{re.escape(argument)}", stderr), stderr


# Each integer option's accepted range (None: unbounded above).
INTEGER_OPTIONS = {"--batch": (1, None), "--seqlen": (1, None), "--seqlen-k": (1, None), "--heads": (1, None),
                   "--heads-k": (1, None), "--head-dim": (1, MAX_HEAD_DIM), "--repeats": (1, None),
                   "--max-workspace-bytes": (-1, MAX_INT64), "--window": (-1, MAX_WINDOW_SIDE)}
# Not "--": CPython 3.11's argparse turns `--batch=--` into an empty list without an error (its own quirk).
TEXTS = st.one_of(st.integers(-2 ** 70, 2 ** 70).map(str),
                  st.sampled_from(["0", "-1", "-2", "1", "3", "256", "257", str(2 ** 63 - 1), str(2 ** 63), "1.5",
                                   "1e3", "", "x", "nan", "inf", " 4", "0x10", "-x"]),
                  st.text(max_size=4).filter(lambda text: text != "--"))


def _as_int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


@settings(max_examples=300, **SETTINGS)
@given(option=st.sampled_from(sorted(INTEGER_OPTIONS)), text=TEXTS)
def test_integer_options_are_parsed_or_refused_in_one_line(option, text):
    low, high = INTEGER_OPTIONS[option]
    base = [*SMALL, "--heads", "12"] if option == "--heads-k" else SMALL      # --heads-k must divide --heads
    tokens = [option, text, "0"] if option == "--window" else [f"{option}={text}"]
    parsed, stderr = _run([*base, *tokens])
    number = _as_int(text)
    valid = number is not None and low <= number and (high is None or number <= high)
    if option == "--heads-k" and valid:
        valid = 12 % number == 0
    if valid:
        assert not isinstance(parsed, int), f"{option} {text!r} was refused: {stderr}"
        got = getattr(parsed, option.removeprefix("--").replace("-", "_"))
        assert (got[0] if option == "--window" else got) == number
    else:
        _assert_one_line_error(parsed, stderr, f"argument {option}")


@settings(max_examples=60, **SETTINGS)
@given(heads=st.integers(1, 12), heads_k=st.one_of(st.none(), st.integers(1, 12)))
def test_heads_k_defaults_to_heads_and_must_divide_it(heads, heads_k):
    argv = [*SMALL, "--heads", str(heads)] + ([] if heads_k is None else ["--heads-k", str(heads_k)])
    parsed, stderr = _run(argv)
    if heads_k is None or heads % heads_k == 0:
        assert parsed.heads_k == (heads if heads_k is None else heads_k)
    else:
        _assert_one_line_error(parsed, stderr, "argument --heads-k: expected a divisor of --heads")


@settings(max_examples=40, **SETTINGS)
@given(text=st.one_of(st.floats(-2, 2).map(str), st.sampled_from(["nan", "inf", "-0.0", "0.99", "1", "x", ""])))
def test_dropout_is_a_probability(text):
    parsed, stderr = _run([*SMALL, f"--dropout={text}"])
    try:
        valid = 0.0 <= float(text) < 1.0
    except ValueError:
        valid = False
    if valid:
        assert parsed.dropout == float(text)
    else:
        _assert_one_line_error(parsed, stderr, "argument --dropout: expected a probability in [0, 1)")


@pytest.mark.parametrize("argv, argument", [
    (["--device", "no_such_device"], "argument --device"),
    (["--backend", "bogus"], "argument --backend"),
    (["--dtype", "fp8"], "argument --dtype"),
    (["--backend", "ck"], "backend 'ck' cannot run this call"),      # NoBackendError: one line too
    (["--max-workspace-bytes", "16"], "backend 'reference': the backward needs at least"),      # WorkspaceError
])
def test_library_and_choice_errors_are_one_line(argv, argument):
    status, stderr = _run([*SMALL, *argv], parse_only=False)
    _assert_one_line_error(status, stderr, argument)


@settings(max_examples=8, **SETTINGS)
@given(seqlen=st.integers(1, 9), seqlen_k=st.one_of(st.none(), st.integers(1, 9)), group=st.sampled_from([1, 3]),
       heads_k=st.integers(1, 2), head_dim=st.integers(1, 24), causal=st.booleans())
# every row attends one key: dq, dk exactly 0 in fp32 SDPA and fp16 SDPA, ours a unit of fp32 accumulation off
@example(seqlen=1, seqlen_k=None, group=1, heads_k=1, head_dim=15, causal=False)
def test_small_valid_arguments_run(seqlen, seqlen_k, group, heads_k, head_dim, causal):
    argv = ["--device", "cpu", "--batch", "1", "--seqlen", str(seqlen), "--heads", str(group * heads_k),
            "--head-dim", str(head_dim), "--repeats", "1", "--dtype", "fp16"]
    argv += ([] if seqlen_k is None else ["--seqlen-k", str(seqlen_k)]) + ["--causal"] * causal
    if heads_k != group * heads_k:
        argv += ["--heads-k", str(heads_k)]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(argv) == 0
    # It runs and reports (the kernels' accuracy is the other tests' subject; at a few fp16 elements the printed
    # ratio, which leaves out the 2x rule's atol, can exceed 2).
    text = out.getvalue()
    assert len(re.findall(r"^  (out|dq|dk|dv) +max\|ours - fp32 SDPA\| = \d", text, re.M)) == 4, text
    assert f"h={group * heads_k}/{heads_k}" in text and "backward workspace (reference)" in text, text


class _Broken(ReferenceBackend):
    """The reference backend with one result scaled by `factor` (a deliberately broken kernel)."""

    def __init__(self, result: str, factor: float):
        self.result, self.factor = result, factor

    def forward(self, problem, params, out, lse):
        super().forward(problem, params, out, lse)
        if self.result == "out":
            out.mul_(self.factor)

    def backward(self, problem, params, out, lse, dout, dq, dk, dv, workspace):
        super().backward(problem, params, out, lse, dout, dq, dk, dv, workspace)
        grads = dict(dq=dq, dk=dk, dv=dv)
        if self.result in grads:
            grads[self.result].mul_(self.factor)


@settings(max_examples=12, **SETTINGS)
@given(result=st.sampled_from(["out", "dq", "dk", "dv"]), factor=st.sampled_from([0.5, 1.25, 1.5, -1.0]),
       causal=st.booleans())
def test_the_main_job_fails_a_result_outside_the_rule(result, factor, causal):
    """A backend whose out, dq, dk or dv is off by a quarter or more: the main job prints FAIL and exits 1; the same
    call on the unbroken backend PASSes with 0 (MHA: a GQA call's dk/dv are the pipeline's sum of other buffers)."""
    argv = SMALL[:-2] + ["--seqlen", "24", "--repeats", "1", "--backend", "reference"] + \
        ["--causal"] * causal
    for backend, code, verdict in ((_Broken(result, factor), 1, "FAIL"), (_Broken(result, 1.0), 0, "PASS")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), fa.use_backend(backend):
            assert main(argv) == code, out.getvalue()
        assert f"  {verdict}: the 2x rule" in out.getvalue()


def test_the_main_job_checks_the_capped_backward(monkeypatch):
    """With --max-workspace-bytes the backward it judges is the capped one it then times."""
    import flash_attn_ck.__main__ as job
    calls = []

    def recording(*args, **kwargs):
        calls.append(kwargs.get("max_workspace_bytes"))
        return fa.flash_attn_bwd(*args, **kwargs)
    monkeypatch.setattr(job, "flash_attn_bwd", recording)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main([*SMALL, "--max-workspace-bytes", "200000"]) == 0
    assert calls and set(calls) == {200000} and "PASS" in out.getvalue()
