"""MNN's and numpy's aarch64 wheels for the arm64 Python 3.11, fetched by pip with pinned hashes.

``pip download --require-hashes`` refuses a wheel whose SHA256 is not the one below (the files
PyPI serves for these versions); the wheels are then unzipped into one site folder (a wheel is a
zip archive whose members are the installed files).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from llmexport.mnn.arm.debian import FetchError

PLATFORM = "manylinux2014_aarch64"
PYTHON_VERSION = "3.11"  # Debian bookworm's python3.11
#: name==version -> SHA256 of its cp311 aarch64 wheel
WHEELS = {
    "MNN==3.6.1": "7f8fbf264047e81bf66f0b04ef95a8c83b8d5ca0a3670afcf3c0c3b6861de4a5",
    "numpy==2.2.6": "b64d8d4d17135e00c8e346e0a738deb17e754230d7e0810ac5012750bbd85a5a",
}


def unzip_wheel(wheel: Path, site: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        for info in archive.infolist():
            name = PurePosixPath(info.filename)
            if name.is_absolute() or ".." in name.parts:
                raise FetchError(f"{wheel.name}: member {info.filename} leaves the folder; refused")
            archive.extract(info, site)
            if (info.external_attr >> 16) & 0o111:
                (site / name).chmod(0o755)


def fetch_wheels(site: Path, log=print) -> dict[str, str]:
    """Download the pinned wheels and unzip them into ``site``; returns requirement -> SHA256."""
    with tempfile.TemporaryDirectory(prefix="llmexport-wheels-") as tmp:
        requirements = Path(tmp) / "requirements.txt"
        requirements.write_text("".join(f"{req} --hash=sha256:{sha}\n" for req, sha in WHEELS.items()))
        log(f"arm64 runtime: {', '.join(WHEELS)} ({PLATFORM}, cp{PYTHON_VERSION.replace('.', '')}) through pip")
        proc = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                               "--require-hashes", "--platform", PLATFORM, "--python-version", PYTHON_VERSION,
                               "--implementation", "cp", "-r", str(requirements), "-d", str(Path(tmp) / "w")],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise FetchError(f"pip could not download the aarch64 wheels ({', '.join(WHEELS)}): {last}")
        wheels = sorted((Path(tmp) / "w").glob("*.whl"))
        if len(wheels) != len(WHEELS):
            raise FetchError(f"pip downloaded {[w.name for w in wheels]}, expected {len(WHEELS)} wheels")
        for wheel in wheels:
            unzip_wheel(wheel, site)
    return dict(WHEELS)
