"""The destination's lifecycle under signals and crashes: SIGTERM cleans up like Ctrl-C, a SIGKILLed
run's leftovers are reaped by the next run (only dead runs', only ours), and the swap never leaves
``--dst_path`` missing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from llmexport.targets.staging import StagedExport, reap_stale

from hostile import CLI, SENTINEL, make_old_dst


def _leftovers(dst: Path) -> list[str]:
    return sorted(p.name for p in dst.parent.glob(f".{dst.name}.*"))


def _unchanged(dst: Path) -> bool:
    return sorted(p.name for p in dst.iterdir()) == ["previous.txt"] and (dst / "previous.txt").read_text() == SENTINEL


#: the command line, held after its first weight record until a signal arrives: a marker file says the
#: run is inside its staging folder with weights written, so no signal races the end of the export
_HELD_EXPORT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from llmexport.mnn.weights import WeightFileWriter
    marker, real_write = Path(sys.argv[1]), WeightFileWriter.write_linear
    def write_and_hold(self, *args, **kwargs):
        record = real_write(self, *args, **kwargs)
        if not marker.exists():
            self._file.flush()
            marker.write_text("held")
            time.sleep(600)  # the test's signal ends this
        return record
    WeightFileWriter.write_linear = write_and_hold
    sys.argv = ["llmexport", *sys.argv[2:]]
    from llmexport.cli import main
    main()
""")


def _default_termination_signals() -> None:
    """In the child: SIGINT, SIGHUP and SIGTERM as a terminal's foreground job has them, whatever the suite
    inherited (under ``nohup`` or ``&`` in a script, SIGHUP and SIGINT arrive ignored, and the child would
    rightly keep ignoring them)."""
    for signum in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(signum, signal.SIG_DFL)


def _start_export(model: Path, dst: Path, marker: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HELD_EXPORT, str(marker), "--path", str(model), "--dst_path",
                             str(dst), "--quant_bit", "4", "--hqq", "--quiet"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=_default_termination_signals)


def _wait_until_held(proc: subprocess.Popen, dst: Path, marker: Path, timeout: float = 300) -> None:
    """Returns once the run is held inside its first weight record, in its staging folder."""
    deadline = time.time() + timeout
    while not marker.exists():
        assert proc.poll() is None, f"the export ended before it was held: {proc.communicate()}"
        assert time.time() < deadline, "the export never reached its first weight record"
        time.sleep(0.01)
    partial = list(dst.parent.glob(f".{dst.name}.*.partial/llm.mnn.weight"))
    assert partial and partial[0].stat().st_size > 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_termination_signals_clean_up_and_leave_dst_unchanged(wide_model, tmp_path, signum):
    dst, marker = make_old_dst(tmp_path), tmp_path / "held"
    proc = _start_export(wide_model, dst, marker)
    _wait_until_held(proc, dst, marker)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err
    assert "interrupted" in err and "left unchanged" in err
    assert _unchanged(dst) and _leftovers(dst) == []


@pytest.mark.slow
def test_sigkill_leftovers_are_reaped_by_the_next_run(wide_model, tiny_gemma4, tmp_path):
    dst, marker = make_old_dst(tmp_path), tmp_path / "held"
    proc = _start_export(wide_model, dst, marker)
    _wait_until_held(proc, dst, marker)
    proc.kill()
    proc.wait()
    left = _leftovers(dst)
    assert any(name.endswith(".partial") for name in left) and any(name.endswith(".lock") for name in left)
    assert _unchanged(dst)
    done = subprocess.run([*CLI, "--path", str(tiny_gemma4("31b", text_only=True)), "--dst_path", str(dst),
                           "--export", "onnx", "--quiet"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert _leftovers(dst) == [] and (dst / "llm.onnx").exists()


def test_reaping_spares_live_runs_and_other_destinations(tmp_path):
    dst, other = make_old_dst(tmp_path), tmp_path / "other"
    with StagedExport(dst) as live, StagedExport(other) as neighbour:
        (live.path / "x").write_text("being written")
        assert reap_stale(dst) == [] and reap_stale(other) == []
        assert (live.path / "x").exists() and neighbour.path.exists()
    assert _leftovers(dst) == [] and _leftovers(other) == []


def test_foreign_files_beside_dst_are_never_touched(tmp_path):
    dst = make_old_dst(tmp_path)
    foreign = [tmp_path / f".{dst.name}.llmexport-feed.lock", tmp_path / f".{dst.name}.llmexport-feed.partial",
               tmp_path / f".{dst.name}.backup"]
    foreign[0].write_text('{"tool": "something else"}')
    foreign[1].mkdir()
    foreign[2].mkdir()
    assert reap_stale(dst) == []
    assert all(p.exists() for p in foreign)


_KILL_DURING_SWAP = textwrap.dedent("""
    import os, signal, sys
    from pathlib import Path
    import llmexport.targets.staging as staging
    dst, mode = Path(sys.argv[1]), sys.argv[2]
    real_rename, real_exchange = os.rename, staging._exchange
    def dying_rename(a, b):
        real_rename(a, b)
        if Path(b).name.endswith(".old"):   # the first of the two renames is done
            os.kill(os.getpid(), signal.SIGKILL)
    def dying_exchange(a, b):
        assert real_exchange(a, b), "this file system cannot exchange folders"
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "two-renames":
        staging._exchange = lambda a, b: False
        os.rename = dying_rename
    else:
        staging._exchange = dying_exchange
    with staging.StagedExport(dst) as run:
        (run.path / "new.txt").write_text("new export")
        run.commit()
""")


@pytest.mark.parametrize("mode", ["two-renames", "exchange"])
def test_sigkill_inside_the_swap_never_loses_the_export(tmp_path, mode):
    dst = make_old_dst(tmp_path)
    proc = subprocess.run([sys.executable, "-c", _KILL_DURING_SWAP, str(dst), mode], capture_output=True, text=True)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    if mode == "two-renames":
        assert not dst.exists()  # the window the reaper must close
    else:
        assert (dst / "new.txt").read_text() == "new export"  # the exchange is atomic
    reap_stale(dst)
    assert _leftovers(dst) == []
    if mode == "two-renames":
        assert _unchanged(dst)
    else:
        assert sorted(p.name for p in dst.iterdir()) == ["new.txt"]


def test_swap_replaces_atomically_and_keeps_nothing_else(tmp_path):
    dst = make_old_dst(tmp_path)
    with StagedExport(dst) as run:
        (run.path / "new.txt").write_text("new")
        run.commit()
    assert sorted(p.name for p in dst.iterdir()) == ["new.txt"] and _leftovers(dst) == []


def test_destination_through_a_symlink_replaces_its_target(tmp_path, tiny_gemma4):
    from click.testing import CliRunner

    from llmexport.cli import main

    target = make_old_dst(tmp_path / "real")
    link = tmp_path / "link"
    link.symlink_to(target, target_is_directory=True)
    result = CliRunner().invoke(main, ["--path", str(tiny_gemma4("31b", text_only=True)), "--dst_path", str(link),
                                       "--export", "onnx", "--quiet"])
    assert result.exit_code == 0, result.output
    assert link.is_symlink() and (link / "llm.onnx").exists() and not (target / "previous.txt").exists()


def test_staging_folder_mode_follows_umask(tmp_path):
    old = os.umask(0o027)
    try:
        with StagedExport(tmp_path / "dst") as run:
            assert run.path.stat().st_mode & 0o777 == 0o750
    finally:
        os.umask(old)
