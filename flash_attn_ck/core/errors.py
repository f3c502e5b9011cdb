"""The errors flash_attn_ck raises on purpose, each naming what to change."""

from __future__ import annotations


class ArgumentError(ValueError):
    """A bad argument to a flash_attn_ck function."""


class WorkspaceError(RuntimeError):
    """The backward's workspace does not fit under the cap, even in its smallest chunk."""


class NoBackendError(RuntimeError):
    """No backend (or not the requested one) can run the call; the message lists every refusal."""


class KernelCompileError(RuntimeError):
    """A kernel that its compiler failed to compile: names the kernel, the compiler's release, the call (where the
    backend knows it) and the compiler's first error line. The compiler's whole output (MLIR and the like) is kept in
    `compiler_output` and never printed."""

    def __init__(self, kernel_name: str, compiler: str, first_error: str, compiler_output: str = "", call: str = ""):
        self.kernel_name, self.compiler, self.first_error = kernel_name, compiler, first_error
        self.compiler_output, self.call = compiler_output, call
        for_call = f" for the call ({call})" if call else ""
        super().__init__(f"kernel {kernel_name} failed to compile with {compiler}{for_call}: {first_error}")

    def for_call(self, call: str) -> KernelCompileError:
        """The same error, naming the call."""
        return KernelCompileError(self.kernel_name, self.compiler, self.first_error, self.compiler_output, call)
