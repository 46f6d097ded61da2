"""Where a runtime child process runs (``mnn/runtime.py``): this host's Python, or MNN's ARM kernels.

On an ARM host (``platform.machine()`` aarch64/arm64) the ARM machine is the host itself: its own
Python and MNN, no set-up. Elsewhere it is the cached arm64 runtime (``cache.py``) under
``qemu-aarch64-static -cpu max`` (MNN then reports ``i8sdot:1, fp16:1, i8mm: 1``), the arm64
interpreter run directly with ``QEMU_LD_PREFIX`` (no chroot, no binfmt_misc). Every machine puts
this package's root on the child's ``PYTHONPATH``: the child side (``mnn/runtime.py``) imports
only numpy, MNN and llmexport's torch-free modules.
"""

from __future__ import annotations

import os
import platform
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from llmexport.errors import UsageError

#: the emulator's command (a name on PATH or a path); Debian/Ubuntu's qemu-user-static installs it
QEMU_ENV = "LLMEXPORT_QEMU"
QEMU = "qemu-aarch64-static"
QEMU_PACKAGE = "qemu-user-static"
PACKAGE_ROOT = str(Path(__file__).resolve().parents[3])
#: numpy's OpenBLAS starts a thread per core at import, which under qemu-user and a busy host made
#: ``import numpy`` take 23 s instead of 3.7 s (measured); the child needs no BLAS threads
_ONE_BLAS_THREAD = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
#: the host's variables an arm64 interpreter must not see (they name the host's Python)
_HOST_PYTHON_VARS = ("PYTHONHOME", "PYTHONPATH", "PYTHONSTARTUP", "PYTHONEXECUTABLE", "VIRTUAL_ENV")


@dataclass(frozen=True)
class Machine:
    """A child's interpreter command and the environment it adds to (or removes from) the parent's."""

    name: str  # "host", "arm64 (native)", "arm64 (qemu-aarch64-static -cpu max)"
    interpreter: tuple[str, ...]
    pythonpath: tuple[str, ...] = ()  # before the package root
    env: dict[str, str] = field(default_factory=dict)
    drop: tuple[str, ...] = ()

    @property
    def is_arm(self) -> bool:
        return self.name.startswith("arm64")

    def command(self, module: str) -> list[str]:
        return [*self.interpreter, "-m", module]

    def environment(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in self.drop}
        inherited = [] if "PYTHONPATH" in self.drop else [os.environ.get("PYTHONPATH", "")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [*self.pythonpath, PACKAGE_ROOT, *inherited]))
        env.update(self.env)
        return env


HOST = Machine("host", (sys.executable,))


def is_arm_host() -> bool:
    return platform.machine().lower() in ("aarch64", "arm64")


def emulator() -> str:
    """The emulator's path; a one-line UsageError naming the package when it is missing."""
    name = os.environ.get(QEMU_ENV) or QEMU
    found = shutil.which(name)
    if found is None:
        raise UsageError(f"MNN's ARM kernels on this {platform.machine()} machine run under {name}, which is not "
                         f"installed: install Debian/Ubuntu's {QEMU_PACKAGE} (apt-get install {QEMU_PACKAGE})")
    return found


def arm_machine(ensure: Callable[..., object] | None = None) -> Machine:
    """The machine with MNN's ARM kernels: this host on ARM, else the cached arm64 runtime under
    the emulator (set up first when missing; the emulator is looked up before any download)."""
    if is_arm_host():
        return Machine("arm64 (native)", (sys.executable,))
    qemu = emulator()
    from llmexport.mnn.arm.cache import ArmRuntime, ensure_runtime

    runtime = (ensure or ensure_runtime)()
    assert isinstance(runtime, ArmRuntime)
    return Machine(f"arm64 ({Path(qemu).name} -cpu max)", (qemu, "-cpu", "max", str(runtime.python), "-s"),
                   pythonpath=(str(runtime.site),), env={"QEMU_LD_PREFIX": str(runtime.root), **_ONE_BLAS_THREAD},
                   drop=_HOST_PYTHON_VARS)
