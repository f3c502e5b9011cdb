"""CPU tests of what the Triton backend does across Triton releases (backends/triton/runtime/triton_versions.py): the
tested range and its refusal, the Gluon names that moved, the direct launch path's private APIs, a compiler failure
held back as a KernelCompileError naming kernel, Triton and call, and the warp-specialised kernels giving way to the
one-launch ones (with one warning) where they cannot run. Each kernel family compiles under the installed Triton in
tests/triton/test_triton_ws.py, test_triton_fwd_ws.py, test_ptx_compare.py and scripts/triton_compile_check.py (which CI
also runs under the newest supported Triton)."""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

triton = pytest.importorskip("triton")

from gluon_compile import pretend_capability, ws_reasons  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from flash_attn_ck import KernelCompileError  # noqa: E402
from flash_attn_ck.backends.triton import backend as triton_backend  # noqa: E402
from flash_attn_ck.backends.triton import config, operators  # noqa: E402
from flash_attn_ck.backends.triton.backend import TritonBackend  # noqa: E402
from flash_attn_ck.backends.triton.runtime import launch, triton_versions  # noqa: E402
from flash_attn_ck.core.mask import MaskInfo  # noqa: E402
from flash_attn_ck.core.problem import AttentionParams, AttentionProblem  # noqa: E402

releases = st.tuples(st.integers(0, 5), st.integers(0, 20), st.integers(0, 9))


@settings(max_examples=200, deadline=None)
@given(release=releases, suffix=st.sampled_from(["", "+git1a2b3c", ".post1", "rc1"]))
def test_the_gluon_kernels_are_refused_outside_the_tested_range(release, suffix):
    """Property: a release inside OLDEST_TESTED..NEWEST_TESTED (any patch, any local suffix) runs them; any other is
    refused in words naming the release and the range."""
    version = ".".join(map(str, release)) + suffix
    refusal = triton_versions.gluon_refusal(version)
    inside = triton_versions.OLDEST_TESTED <= release[:2] <= triton_versions.NEWEST_TESTED
    assert (refusal is None) == inside, (version, refusal)
    if not inside:
        assert version in refusal and triton_versions.tested_range() in refusal


@pytest.mark.parametrize("version", ["", "nightly", "3"])
def test_a_version_without_a_release_is_refused(version):
    assert "outside the tested range" in triton_versions.gluon_refusal(version)


def test_the_installed_triton_is_in_the_tested_range():
    """CI installs only tested releases: the one found here is inside, and is what triton reports."""
    assert triton_versions.installed() == triton.__version__
    assert triton_versions.gluon_refusal() is None


def test_the_moved_gluon_names_are_the_installed_builtins():
    """barrier, tma_load and tma_store are the installed release's builtins under whichever name it has (the newer
    name where it exists), reinterpret a builtin, and the kernels call them through triton_versions alone."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    assert triton_versions.barrier is (getattr(gl, "barrier", None) or gl.thread_barrier)
    assert triton_versions.tma_load is (getattr(tma, "async_load", None) or tma.async_copy_global_to_shared)
    assert triton_versions.tma_store is (getattr(tma, "async_store", None) or tma.async_copy_shared_to_global)
    assert triton.language.core.is_builtin(triton_versions.reinterpret)
    with pytest.raises(AttributeError, match="no attribute 'thread_barrier'"):
        triton_versions.thread_barrier  # noqa: B018
    backend = Path(launch.__file__).parents[1]     # every module of the Triton backend, the kernels' included
    for path in backend.rglob("*.py"):
        if path.name != "triton_versions.py":
            text = path.read_text()
            for moved in ("thread_barrier(", "async_copy_global_to_shared(", "async_copy_shared_to_global(",
                          "gl.barrier(", "tma.async_load(", "tma.async_store(", "._reinterpret(", ".reinterpret("):
                assert moved not in text, f"{path.name} calls {moved} directly"


def test_the_launch_path_finds_its_private_apis():
    triton_versions.launch_path_refusal.cache_clear()
    assert triton_versions.launch_path_refusal() is None


def test_a_moved_launcher_is_named(monkeypatch):
    """A Triton whose CUDA launcher takes other parameters: the direct path is refused in words (launch_kernel then
    launches through kernel[grid])."""
    from triton.backends.nvidia import driver

    def moved(self, grid, stream, function, *args):
        pass
    monkeypatch.setattr(driver.CudaLauncher, "__call__", moved)
    triton_versions.launch_path_refusal.cache_clear()
    try:
        refusal = triton_versions.launch_path_refusal()
    finally:
        triton_versions.launch_path_refusal.cache_clear()
    assert refusal == f"Triton {triton.__version__}: the CUDA launcher takes (grid, stream, function, args)"


# ---- a compiler failure -------------------------------------------------------------------------------------------

MLIR_DUMP = "module {\n  tt.func @attn_bwd_kernel() {\n" + "    %0 = arith.constant 0 : i32\n" * 50 + "  }\n}\n"


def _fail_like_the_pipeliner():
    os.write(2, b"/x/tiles.py:30:41: error: 'ttng.tensormap_create' op pipeliner doesn't know how to predicate "
                b"this op\n" + MLIR_DUMP.encode())
    raise RuntimeError("PassManager::run failed")


def test_a_compiler_failure_is_one_line_and_prints_no_mlir(capfd):
    with pytest.raises(KernelCompileError) as caught, launch.compiler_output_held(_fail_like_the_pipeliner):
        _fail_like_the_pipeliner()
    out, err = capfd.readouterr()
    assert "tt.func" not in out + err and "arith.constant" not in str(caught.value)
    error = caught.value
    assert error.kernel_name == "_fail_like_the_pipeliner" and error.compiler == f"Triton {triton.__version__}"
    assert error.first_error == "'ttng.tensormap_create' op pipeliner doesn't know how to predicate this op"
    assert "tt.func" in error.compiler_output     # kept for whoever asks, not shown
    assert str(error) == (f"kernel _fail_like_the_pipeliner failed to compile with Triton {triton.__version__}: "
                          f"{error.first_error}")


def test_what_a_successful_compile_writes_still_reaches_stderr(capfd):
    with launch.compiler_output_held(test_what_a_successful_compile_writes_still_reaches_stderr):
        os.write(2, b"a compiler warning\n")
    assert capfd.readouterr().err == "a compiler warning\n"


def test_an_error_of_the_launch_itself_passes_unchanged(capfd):
    """Not a compiler failure (a CUDA error, a bad argument): the same exception, and what was written is shown."""
    def launch_fails():
        os.write(2, b"from the driver\n")
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    with pytest.raises(RuntimeError, match="CUDA error: an illegal memory access"), \
            launch.compiler_output_held(launch_fails):
        launch_fails()
    assert capfd.readouterr().err == "from the driver\n"


def test_a_front_end_error_keeps_its_message():
    from triton.compiler.errors import CompilationError

    def front_end():
        raise CompilationError("def k(x):\n    gl.thread_barrier()\n", None, "module has no attribute thread_barrier")
    with pytest.raises(KernelCompileError, match="module has no attribute thread_barrier"), \
            launch.compiler_output_held(front_end):
        front_end()


# ---- the warp-specialised kernels give way to the one-launch ones --------------------------------------------------

def _problem(heads=(8, 2), seqlen=4096, head_dim=128, **features):
    mask = MaskInfo.from_flash_args(True, (-1, -1), seqlen, seqlen)
    return AttentionProblem(2, seqlen, seqlen, *heads, head_dim, torch.bfloat16, torch.device("cuda"), mask,
                            head_dim ** -0.5, **features)


@pytest.fixture
def fresh_process(monkeypatch):
    """No kernel has failed to compile and no warning has been given (as at a process's start)."""
    monkeypatch.setattr(operators, "FAILED_TO_COMPILE", {})
    monkeypatch.setattr(operators, "_WARNED", set())


def test_a_triton_outside_the_range_runs_the_one_launch_kernels_and_says_so(monkeypatch, fresh_process):
    monkeypatch.setattr(triton_versions, "installed", lambda: "3.10.0")
    with pretend_capability(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        reasons = ws_reasons(TritonBackend(), _problem())
        assert any("Triton 3.10.0 is outside the tested range 3.6-3.9" in r for r in reasons), reasons
        fwd = TritonBackend().forward_kernel(_problem(seqlen=8192))
        plan = TritonBackend().backward_plan(_problem(seqlen=8192))
    assert len(w) == 1 and "Triton 3.10.0 is outside the tested range" in str(w[0].message)   # once per process
    assert fwd.startswith("forward (") and "Triton 3.10.0" in fwd
    assert plan.kernel.startswith("bwd_main") and "Triton 3.10.0" in plan.kernel
    with pretend_capability(), warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ws_reasons(TritonBackend(ws=True), _problem(seqlen=8192)) == []   # forced: the user's risk


class _Runs:
    """Stands in for the kernels: records which ran; the warp-specialised ones fail to compile."""

    def __init__(self, monkeypatch):
        self.ran = []
        error = KernelCompileError("attn_bwd_ws_kernel", f"Triton {triton.__version__}", "an op it cannot lower")

        def failing(name):
            def run(operator, backend, *args):
                self.ran.append(name)
                raise error
            return classmethod(run)

        def one_launch(name):
            def run(operator, backend, p, params, *rest):
                self.ran.append((name, backend.dq_mode, backend.gqa_epilogue, tuple(rest[-1]) if name[0] == "b"
                                 else ()))
            return classmethod(run)
        monkeypatch.setattr(operators.BwdWs, "run", failing("bwd_ws"))
        monkeypatch.setattr(operators.FwdWs, "run", failing("fwd_ws"))
        for operator in (operators.BwdMain, operators.BwdMainAtomicDq):
            monkeypatch.setattr(operator, "run", one_launch("bwd_main"))
        monkeypatch.setattr(operators.Forward, "run", one_launch("forward"))
        monkeypatch.setattr(triton_backend, "_prepare_launch", lambda: None)


def test_a_gluon_kernel_that_fails_to_compile_gives_way_for_good(monkeypatch, fresh_process):
    """The first call that meets the failure runs on the accumulator-free one-launch backward with the plan it was
    given (its softmax_d only); one warning; later calls are planned for the one-launch kernels, which the plan's
    kernel line says, with the failure as the reason."""
    runs = _Runs(monkeypatch)
    p = _problem(seqlen=8192)
    q = torch.zeros(2, 8192, 8, 128, dtype=torch.bfloat16)
    k = torch.zeros(2, 8192, 2, 128, dtype=torch.bfloat16)
    params = AttentionParams(q, k, k)
    backend = TritonBackend()
    with pretend_capability():
        plan = backend.backward_plan(p)
        assert plan.kernel.startswith("bwd_ws")
        workspace = {buffer.name: torch.zeros(1) for buffer in plan.buffers}
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            backend.backward(p, params, q, None, q, q, k, k, workspace)
            replanned = backend.backward_plan(p)      # the pipeline plans the next call again (the memo was emptied)
            backend.backward(p, params, q, None, q, q, k, k, {buffer.name: torch.zeros(1)
                                                               for buffer in replanned.buffers})
            later_plan = TritonBackend().backward_plan(_problem(seqlen=16384))
        assert len(w) == 1 and "attn_bwd_ws_kernel failed to compile" in str(w[0].message)
    assert replanned.kernel.startswith("bwd_main")
    assert runs.ran == ["bwd_ws", ("bwd_main", "pass", "loop", ("softmax_d",)),
                        ("bwd_main", backend.dq_mode, backend.gqa_epilogue, tuple(b.name for b in replanned.buffers))]
    assert later_plan.kernel.startswith("bwd_main") and "attn_bwd_ws_kernel failed to compile with Triton" in \
        later_plan.kernel and "an op it cannot lower" in later_plan.kernel
    assert later_plan.buffers[0].name == "softmax_d"


def test_a_failed_gluon_forward_runs_the_older_forward(monkeypatch, fresh_process):
    runs = _Runs(monkeypatch)
    p = _problem(seqlen=8192)
    q = torch.zeros(2, 8192, 8, 128, dtype=torch.bfloat16)
    with pretend_capability(), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        TritonBackend().forward(p, AttentionParams(q, q, q), q, None)
        TritonBackend().forward(p, AttentionParams(q, q, q), q, None)
        kernel = TritonBackend().forward_kernel(_problem(seqlen=16384))
    assert len(w) == 1 and "its calls run on the one-launch Triton kernels" in str(w[0].message)
    assert runs.ran == ["fwd_ws", ("forward", "auto", "loop", ()), ("forward", "auto", "loop", ())]
    assert kernel.startswith("forward (") and "failed to compile" in kernel


def test_a_one_launch_kernel_that_fails_to_compile_names_the_call(monkeypatch, fresh_process):
    """No other kernel can run it: the error names the kernel, the Triton release and the call's shape and features."""
    def failing(*args, **kwargs):
        raise KernelCompileError("attn_bwd_kernel", f"Triton {triton.__version__}", "pipeliner failure")
    monkeypatch.setattr(launch.LaunchSpec, "launch", lambda spec: failing())
    monkeypatch.setattr(triton_backend, "_prepare_launch", lambda: None)
    p = AttentionProblem(2, 1, 2049, 9, 3, 80, torch.bfloat16, torch.device("cuda"),
                         MaskInfo.from_flash_args(False, (-1, -1), 1, 2049), 80 ** -0.5, has_alibi=True)
    backend = TritonBackend(configs=config.SM90[(128, False)])
    q, k = torch.zeros(2, 1, 9, 80, dtype=torch.bfloat16), torch.zeros(2, 2049, 3, 80, dtype=torch.bfloat16)
    with pretend_capability(), pytest.raises(KernelCompileError) as caught:
        backend.backward(p, AttentionParams(q, k, k, alibi_slopes=torch.zeros(9)), q, torch.zeros(2, 9, 1), q, q,
                         k, k, {"softmax_d": torch.zeros(2, 9, 1)})
    message = str(caught.value)
    assert message.startswith(f"kernel attn_bwd_kernel failed to compile with Triton {triton.__version__} for the "
                              "call (b 2, s_q 1, s_k 2049, h 9/3, d 80, bfloat16, mask ")
    assert "ALiBi" in message and message.endswith(": pipeliner failure")


# ---- the one-launch backward at one query row (GQA) ---------------------------------------------------------------

@pytest.mark.parametrize("head_block", [64, 128])
def test_the_group_loop_compiles_at_one_query_row(head_block):
    """GQA at s_q = 1 with TMA loads: a launch makes max_seqlen_q the constant 1, the query-tile loop has one trip and
    the group loop becomes the innermost loop, with a device TMA descriptor made in it. The pipeliner cannot
    predicate that (MLIR 'PassManager::run failed' on the H200 for every such call): the group loop is never
    pipelined."""
    from triton_compile_check import compile_one, older_variants
    name = f"attn_bwd_kernel d{head_block} ones varlen=False loop=True dq_atomic=False det=True gqa"
    spec = dict(older_variants([head_block], name))[name]
    assert spec.args["sizes"].group == 2 and spec.args["sizes"].max_seqlen_q == 1 and spec.args["features"].TMA_LOADS
    assert "wgmma" in compile_one(spec, as_launched=True)["asm"]["ptx"]


def test_a_moved_gluon_name_is_a_compile_error_of_the_kernel():
    """A kernel calling a name that is no longer a Gluon builtin (as a renamed API leaves it): Triton's JIT raises a
    plain RuntimeError while reading the kernel's globals ('Unsupported function referenced'), which counts as the
    kernel failing to compile, not as a launch error. In a fresh process: Triton caches what it read of a kernel."""
    import subprocess
    import textwrap
    root = Path(__file__).resolve().parents[2]
    script = textwrap.dedent(f"""
        import sys
        sys.path[:0] = [{str(root)!r}, {str(root / "tests")!r}]
        from flash_attn_ck import KernelCompileError
        from flash_attn_ck.backends.triton import config
        from flash_attn_ck.backends.triton.gluon import bwd_ws
        from flash_attn_ck.backends.triton.runtime import launch
        from gluon_compile import bwd_spec, compile_spec
        bwd_ws.barrier = lambda: None
        try:
            with launch.compiler_output_held(bwd_ws.attn_bwd_ws_kernel):
                compile_spec(bwd_spec(config.BWD_WS_SM90[128], 128))
        except KernelCompileError as error:
            print("caught:", error)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert "caught: kernel attn_bwd_ws_kernel failed to compile with Triton" in run.stdout, run.stdout + run.stderr
    assert "Unsupported function referenced" in run.stdout
