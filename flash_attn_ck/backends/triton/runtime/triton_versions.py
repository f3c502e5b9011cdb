"""The Triton releases this backend runs on, and every API difference between them, in one place.

Kernels import the Gluon names that moved between releases from here (`barrier`, `tma_load`, `tma_store`,
`reinterpret`), never from Triton directly, and nothing else in the package reads Triton's version. The backend asks
`gluon_refusal()` whether the warp-specialised kernels may run under the installed Triton, and `launch_path_refusal()`
whether launch.py's direct launch path finds the private Triton APIs it reads.

Adding a release: compile every kernel against it (`python scripts/triton_matrix.sh VERSION`, which runs
scripts/triton_compile_check.py and the CPU compile tests under that wheel), give a moved name its alias below, then
raise `NEWEST_TESTED` and the pins in pyproject.toml, and record the run in the README's table of versions.
"""

from __future__ import annotations

import functools
import inspect
import re

# The releases every kernel family compiles on (scripts/triton_compile_check.py: 0 failed), by (major, minor):
# the Tritons that torch 2.11 to 2.15 pin.
OLDEST_TESTED = (3, 6)
NEWEST_TESTED = (3, 9)


@functools.cache
def installed() -> str:
    """The installed Triton's version string ('' when it cannot be imported)."""
    try:
        import triton
    except ImportError:
        return ""
    return triton.__version__


def release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a version string such as '3.7.1' or '3.8.0+git1234'; None if it has none."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return (int(found.group(1)), int(found.group(2))) if found else None


def tested_range() -> str:
    return f"{OLDEST_TESTED[0]}.{OLDEST_TESTED[1]}-{NEWEST_TESTED[0]}.{NEWEST_TESTED[1]}"


def gluon_refusal(version: str | None = None) -> str | None:
    """Why the warp-specialised Gluon kernels are not run under Triton `version` (the installed one by default):
    a release outside the tested range, whose Gluon API may have moved again; None inside it."""
    version = installed() if version is None else version
    found = release(version)
    if found is None or not OLDEST_TESTED <= found <= NEWEST_TESTED:
        return f"Triton {version or '(none)'} is outside the tested range {tested_range()} of the Gluon kernels"
    return None


# ---- the direct launch path's private APIs (launch.launch_kernel) --------------------------------------------

# The CUDA launcher's parameters (CompiledKernel.run), in the order launch_kernel passes them before the arguments.
LAUNCHER_PARAMETERS = ("gridX", "gridY", "gridZ", "stream", "function", "kernel_metadata", "launch_metadata",
                       "launch_enter_hook", "launch_exit_hook")


@functools.cache
def launch_path_refusal() -> str | None:
    """Why launch.launch_kernel cannot launch compiled kernels directly under the installed Triton (every launch then
    goes through `kernel[grid](...)`, Triton's own path): a private API it reads is missing or has moved. None where
    each is as it reads it: `native_specialize_impl`, a JITFunction's `device_caches` (whose fourth entry is the
    backend) and `_pack_args`, and the CUDA launcher's parameters."""
    try:
        from triton.backends.nvidia.driver import CudaLauncher
        from triton.runtime.jit import JITFunction, native_specialize_impl  # noqa: F401
    except ImportError as error:
        return f"Triton {installed()}: {error}"
    if not hasattr(JITFunction, "_pack_args"):
        return f"Triton {installed()}: JITFunction has no _pack_args"
    binder = inspect.getsource(JITFunction.create_binder) if hasattr(JITFunction, "create_binder") else ""
    if "self.device_caches" not in inspect.getsource(JITFunction.__init__) or "backend, binder" not in binder:
        return f"Triton {installed()}: JITFunction.device_caches is no longer (..., ..., target, backend, binder)"
    parameters = list(inspect.signature(CudaLauncher.__call__).parameters.values())[1:]
    named = tuple(p.name for p in parameters if p.kind is p.POSITIONAL_OR_KEYWORD)
    # 3.6 names the grid, stream and function and passes the rest on (*args); later releases name all
    rest = any(p.kind is p.VAR_POSITIONAL for p in parameters)
    if named != LAUNCHER_PARAMETERS and not (rest and named == LAUNCHER_PARAMETERS[:len(named)] and len(named) >= 5):
        return f"Triton {installed()}: the CUDA launcher takes ({', '.join(p.name for p in parameters)})"
    return None


# ---- the Gluon names that moved (resolved on first import by a kernel module) ---------------------------------

def __getattr__(name: str):
    """`barrier` (3.7 renamed gl.thread_barrier), `tma_load` and `tma_store` (3.8 added tma.async_load/async_store,
    3.9 removed async_copy_global_to_shared/async_copy_shared_to_global): the builtin of the installed release;
    `reinterpret` (3.9 renamed the shared-memory method _reinterpret): a builtin calling the installed one."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import tma
    moved = {
        "barrier": ("barrier", "thread_barrier", gl),
        "tma_load": ("async_load", "async_copy_global_to_shared", tma),
        "tma_store": ("async_store", "async_copy_shared_to_global", tma),
    }
    if name == "reinterpret":
        value = _reinterpret()
    elif name in moved:
        newer, older, module = moved[name]
        value = getattr(module, newer, None) or getattr(module, older)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def _reinterpret():
    from triton.language.core import builtin

    @builtin
    def reinterpret(buffer, dtype, shape, layout, _semantic=None):
        """`buffer` (shared memory) viewed as a `shape` tile of `dtype` in `layout`."""
        method = getattr(buffer, "reinterpret", None) or buffer._reinterpret
        return method(dtype, shape, layout, _semantic=_semantic)
    return reinterpret
