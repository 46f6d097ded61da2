"""MNN's ARM kernels (llmexport/mnn/arm/): the set-up's pieces on synthetic packages, the machine
selection, and every family's tiny export run on ARM against the stored-weights oracle.

The end-to-end tests run MNN's aarch64 wheel natively on an ARM host, under qemu-aarch64-static
elsewhere (``make arm-runtime``, which ``make test`` runs first, sets it up). The emulated
interpreter costs ~3 s to start and import numpy and MNN, so every family's forward and
conversation step run in ONE child process (``run_calls``).
"""

from __future__ import annotations

import io
import json
import lzma
import tarfile
import threading
import time

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoTokenizer

from llmexport import ExportOptions, export
from llmexport.cli import main
from llmexport.errors import UsageError
from llmexport.mnn.arm import cache, debian, machine
from llmexport.mnn.config import Precision, profile_of
from llmexport.mnn.runtime import chat_call, run_calls, runtime_call
from llmexport.mnn.tokenizer.stream import StreamModel
from llmexport.quant.scheme import QuantScheme
from llmexport.results import VerifyReport
from llmexport.source.checkpoint import Checkpoint
from llmexport.source.loading import open_architecture
from llmexport.tiny.registry import TINY_BUILDERS
from llmexport.verification.arm import ARM_THREADS, precision_bounds, reported_kernels
from llmexport.verification.conversation import USER_TURNS, Conversations, conversation_failures, reference_stop_ids
from llmexport.verification.logits import compare_logits, run_failures
from llmexport.verification.verify import bounds_for_export, default_prompt, reference_pair, stored_bits, stored_tensors

from families import parametrize

# --- the Debian fetcher on synthetic packages ---------------------------------------------------------

INDEX = """Package: python3.11-minimal
Version: 3.11.2-6
Pre-Depends: libc6 (>= 2.36)
Depends: libpython3.11-minimal (= 3.11.2-6), libexpat1 (>= 2.1~beta3), zlib1g:any
Filename: pool/main/p/python3.11/python3.11-minimal_3.11.2-6_arm64.deb
SHA256: {sha}

Package: libpython3.11-minimal
Version: 3.11.2-6
Depends: libc6, libssl3 | libssl-alt
Filename: pool/main/p/python3.11/libpython3.11-minimal_3.11.2-6_arm64.deb
SHA256: 00

Package: libc6
Version: 2.36-9
Depends: libgcc-s1
Filename: pool/main/g/glibc/libc6_2.36-9_arm64.deb
SHA256: 00

Package: libgcc-s1
Version: 12.2.0-14
Depends: gcc-12-base,
 libc6
Filename: pool/main/g/gcc-12/libgcc-s1_12.2.0-14_arm64.deb
SHA256: 00

Package: gcc-12-base
Version: 12.2.0-14
Filename: pool/main/g/gcc-12/gcc-12-base_12.2.0-14_arm64.deb
SHA256: 00

Package: libexpat1
Version: 2.5.0-1
Depends: libc6
Filename: pool/main/e/expat/libexpat1_2.5.0-1_arm64.deb
SHA256: 00

Package: zlib-ng
Version: 1.0
Provides: zlib1g (= 1:1.2.13)
Filename: pool/main/z/zlib-ng/zlib-ng_1.0_arm64.deb
SHA256: 00

Package: libssl3
Version: 3.0.11-1
Filename: pool/main/o/openssl/libssl3_3.0.11-1_arm64.deb
SHA256: 00

Package: unrelated
Version: 1
Filename: pool/main/u/unrelated_1_arm64.deb
SHA256: 00
"""


def test_index_parsing_reads_versions_alternatives_and_continuation_lines():
    index = debian.parse_packages(INDEX.format(sha="ab" * 32))
    python = index["python3.11-minimal"]
    assert python.version == "3.11.2-6" and python.sha256 == "ab" * 32
    assert python.depends == (("libc6",), ("libpython3.11-minimal",), ("libexpat1",), ("zlib1g",))
    assert index["libgcc-s1"].depends == (("gcc-12-base",), ("libc6",))  # a folded Depends line
    assert index["libpython3.11-minimal"].depends[1] == ("libssl3", "libssl-alt")
    assert index["zlib-ng"].provides == ("zlib1g",)


def test_dependency_closure_follows_pre_depends_alternatives_and_provides():
    index = debian.parse_packages(INDEX.format(sha="00"))
    names = [p.name for p in debian.closure(index, ["python3.11-minimal"])]
    assert names == ["gcc-12-base", "libc6", "libexpat1", "libgcc-s1", "libpython3.11-minimal", "libssl3",
                     "python3.11-minimal", "zlib-ng"]
    broken = debian.parse_packages(INDEX.format(sha="00").replace("libexpat1 (>= 2.1~beta3)", "libmissing"))
    with pytest.raises(debian.FetchError, match="holds none of libmissing"):
        debian.closure(broken, ["python3.11-minimal"])


def test_release_sha256_section():
    release = ("Origin: Debian\nSHA256:\n 2ddb17 8689464 main/binary-arm64/Packages.xz\n"
               " c7c883 49434864 main/binary-arm64/Packages\nMD5Sum:\n")
    assert debian.release_sha256(release)["main/binary-arm64/Packages.xz"] == ("2ddb17", 8689464)


def _tar(entries) -> bytes:
    """A data.tar.xz of (name, kind, payload): kind "file" (bytes), "dir", "sym" (target), "link" (target)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:xz") as tar:
        for name, kind, payload in entries:
            info = tarfile.TarInfo(name)
            if kind == "file":
                info.size, info.mode = len(payload), 0o755
                tar.addfile(info, io.BytesIO(payload))
                continue
            info.type = {"dir": tarfile.DIRTYPE, "sym": tarfile.SYMTYPE, "link": tarfile.LNKTYPE}[kind]
            info.linkname = payload if kind != "dir" else ""
            tar.addfile(info)
    return buffer.getvalue()


def _deb(entries) -> bytes:
    """An ar archive as dpkg writes one: debian-binary, control.tar.xz, data.tar.xz."""
    out = bytearray(b"!<arch>\n")
    for name, data in (("debian-binary", b"2.0\n"), ("control.tar.xz", _tar([])), ("data.tar.xz", _tar(entries))):
        out += f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode() + data
        if len(data) % 2:
            out += b"\n"
    return bytes(out)


def test_deb_unpacking_rewrites_absolute_links_inside_the_folder(tmp_path):
    deb = _deb([("./lib", "dir", None), ("./lib/aarch64-linux-gnu/ld-linux-aarch64.so.1", "file", b"ELF"),
                ("./lib/ld-linux-aarch64.so.1", "sym", "/lib/aarch64-linux-gnu/ld-linux-aarch64.so.1"),
                ("./usr/bin/python3.11", "file", b"#!"), ("./usr/bin/python3", "link", "./usr/bin/python3.11")])
    debian.unpack_deb(deb, tmp_path, "test.deb")
    link = tmp_path / "lib" / "ld-linux-aarch64.so.1"
    assert link.is_symlink() and not link.readlink().is_absolute() and link.read_bytes() == b"ELF"
    assert (tmp_path / "usr/bin/python3").read_bytes() == b"#!" and not (tmp_path / "usr/bin/python3").is_symlink()
    assert (tmp_path / "usr/bin/python3.11").stat().st_mode & 0o111


@pytest.mark.parametrize("entries, message", [
    ([("../escape", "file", b"x")], "leaves the folder"),
    ([("./lib", "sym", "/"), ("./lib/../../x", "file", b"x")], "leaves the folder"),
    ([("./out", "sym", "../../.."), ("./out/x", "file", b"x")], "link out -> ../../.. leaves the folder"),
    ([("/abs", "file", b"x")], "leaves the folder"),
])
def test_deb_members_that_leave_the_folder_are_refused(tmp_path, entries, message):
    with pytest.raises(debian.FetchError, match=message):
        debian.unpack_deb(_deb(entries), tmp_path / "root", "evil.deb")
    assert not (tmp_path / "x").exists() and not (tmp_path.parent / "x").exists()


def test_not_a_deb_is_refused(tmp_path):
    with pytest.raises(debian.FetchError, match="not an ar archive"):
        debian.unpack_deb(b"PK\x03\x04", tmp_path, "x.deb")


def _archive(debs: dict[str, bytes], corrupt: str | None = None):
    """A fake mirror: Release -> Packages.xz -> .debs, every SHA256 right (except ``corrupt``'s)."""
    import hashlib

    stanzas = []
    for name, data in debs.items():
        sha = hashlib.sha256(data if name != corrupt else data + b"!").hexdigest()
        stanzas.append(f"Package: {name}\nVersion: 1\nFilename: pool/{name}.deb\nSHA256: {sha}\n"
                       + ("Depends: b\n" if name == "a" else ""))
    packages = lzma.compress("\n".join(stanzas).encode())
    release = f"SHA256:\n {hashlib.sha256(packages).hexdigest()} {len(packages)} main/binary-arm64/Packages.xz\n"
    files = {"Release": release.encode(), "Release.gpg": b"", "main/binary-arm64/Packages.xz": packages}
    files.update({f"pool/{name}.deb": data for name, data in debs.items()})
    return lambda url: files[url.split("/debian/", 1)[1].removeprefix(f"dists/{debian.SUITE}/")]


def test_fetch_root_unpacks_the_closure_and_refuses_a_sha_mismatch(tmp_path, monkeypatch):
    monkeypatch.setattr(debian, "KEYRING", tmp_path / "no-keyring.gpg")  # the fake Release is unsigned
    debs = {"a": _deb([("./usr/bin/a", "file", b"a")]), "b": _deb([("./usr/lib/b", "file", b"b")]),
            "c": _deb([("./usr/lib/c", "file", b"c")])}
    manifest = debian.fetch_root(tmp_path / "root", ["a"], _archive(debs), log=lambda _: None)
    assert manifest["packages"] == {"a": "1", "b": "1"} and manifest["release_signature_checked"] is False
    assert (tmp_path / "root/usr/bin/a").read_bytes() == b"a" and not (tmp_path / "root/usr/lib/c").exists()
    with pytest.raises(debian.FetchError, match=r"pool/b.deb: SHA256 .* refused"):
        debian.fetch_root(tmp_path / "again", ["a"], _archive(debs, corrupt="b"), log=lambda _: None)


# --- the cache and the machine -------------------------------------------------------------------------


def test_an_interrupted_set_up_leaves_no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))

    def failing(folder, log):
        (folder / "root").mkdir()
        raise debian.FetchError("network down")

    with pytest.raises(debian.FetchError, match="network down"):
        cache.ensure_runtime(log=lambda _: None, build=failing)
    assert [p.name for p in tmp_path.iterdir()] == [".lock"]


def test_concurrent_set_ups_build_once(tmp_path, monkeypatch):
    monkeypatch.setenv(cache.CACHE_ENV, str(tmp_path))
    builds = []

    def slow(folder, log):
        builds.append(folder)
        time.sleep(0.3)
        (folder / cache.MANIFEST).write_text("{}")

    results = []
    workers = [threading.Thread(target=lambda: results.append(cache.ensure_runtime(lambda _: None, slow)))
               for _ in range(3)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len(builds) == 1 and len({r.folder for r in results}) == 1
    assert (results[0].folder / cache.MANIFEST).exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", cache.runtime_key()]


def test_machine_selection(tmp_path, monkeypatch):
    monkeypatch.setattr(machine.platform, "machine", lambda: "aarch64")
    native = machine.arm_machine(ensure=lambda: pytest.fail("no set-up on an ARM host"))
    assert native.is_arm and native.interpreter == (machine.sys.executable,)

    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(machine.QEMU_ENV, str(tmp_path / "no-qemu"))
    with pytest.raises(UsageError, match="install Debian/Ubuntu's qemu-user-static") as failed:
        machine.arm_machine(ensure=lambda: pytest.fail("the emulator is looked up before any download"))
    assert "\n" not in str(failed.value)

    qemu = tmp_path / "qemu-aarch64-static"
    qemu.write_text("#!/bin/sh\n")
    qemu.chmod(0o755)
    monkeypatch.setenv(machine.QEMU_ENV, str(qemu))
    monkeypatch.setenv("PYTHONHOME", "/host/python")
    runtime = cache.ArmRuntime(tmp_path / "rt")
    emulated = machine.arm_machine(ensure=lambda: runtime)
    assert emulated.command("m") == [str(qemu), "-cpu", "max", str(runtime.python), "-s", "-m", "m"]
    env = emulated.environment()
    assert env["QEMU_LD_PREFIX"] == str(runtime.root) and "PYTHONHOME" not in env
    assert env["PYTHONPATH"].split(":") == [str(runtime.site), machine.PACKAGE_ROOT]
    assert machine.HOST.environment()["PYTHONHOME"] == "/host/python" and not machine.HOST.is_arm


def test_reported_kernels():
    lines = ["[MNNLLM] load", "The device supports: i8sdot:1, fp16:1, i8mm: 1, sve2: 1, sme2: 0"]
    assert reported_kernels(lines) == {"i8sdot": 1, "fp16": 1, "i8mm": 1, "sve2": 1, "sme2": 0}
    assert reported_kernels(["nothing"]) == {}


# --- every family on MNN's ARM kernels ----------------------------------------------------------------


@pytest.fixture(scope="module")
def arm():
    return machine.arm_machine()


@pytest.fixture(scope="module")
def families_on_arm(tmp_path_factory, arm):
    """Per model type: its tiny checkpoint exported (fp16 records), a forward teacher-forced along
    fixed ids and one conversation turn on ARM at precision normal and, where the family ships it,
    low -- every family in ONE child -- judged against the stored-weights oracle with verification's
    bounds and rules (``precision_bounds``: low at the bound of fp16 arithmetic)."""
    cases, calls = {}, []
    for model_type, build in sorted(TINY_BUILDERS.items()):
        base = tmp_path_factory.mktemp(f"arm-{model_type}")
        path, out = build(base / "hf", 0), base / "out"
        export(path, out, ExportOptions(quant=QuantScheme(16, 64)))
        tokenizer = AutoTokenizer.from_pretrained(path)
        arch = open_architecture(Checkpoint.open(path))
        window = int(arch.llm_config().get("sliding_window") or 0)
        prompt = default_prompt(tokenizer, window + 8)
        forced = tokenizer("The sea is calm, and the boats come home.", add_special_tokens=False)["input_ids"][:8]
        users = [[USER_TURNS[0][0]]]
        for precision in dict.fromkeys(("normal", arch.precision.value)):
            cases[(model_type, precision)] = (path, out, tokenizer, arch, window, prompt, forced, users)
            calls += [runtime_call(out, prompt, forced, 0, config={"thread_num": ARM_THREADS, "precision": precision}),
                      chat_call(out, users, 8, {"thread_num": ARM_THREADS, "precision": precision})]
    output: list[str] = []
    started = time.perf_counter()
    results = run_calls(calls, arm, output=output)
    seconds = time.perf_counter() - started
    judged = {}
    for i, ((model_type, precision), (path, out, tokenizer, arch, window, prompt, forced, users)) in \
            enumerate(cases.items()):
        run, chat = results[2 * i], results[2 * i + 1]
        stored = stored_tensors(out, arch)
        profile = profile_of(json.loads((out / "config.json").read_text()))
        bounds = precision_bounds(bounds_for_export(stored_bits(stored, None), profile), precision)
        oracle, fp32 = reference_pair(arch, stored, arch.reference_is_remote_code)
        ids = torch.tensor(prompt + forced)
        forward = compare_logits(run.forced_logits, arch.reference_logits(oracle, ids, len(prompt) - 1).numpy())
        conversations = Conversations.of(out, users, window, chat)
        conversations.add_oracle(arch, oracle, reference_stop_ids(path, tokenizer, arch))
        conversations.add_fp32(arch, fp32)
        check = conversations.check(tokenizer, StreamModel.from_folder(path))
        failures = run_failures("", forward, bounds.max_abs_err, bounds.mean_abs_err) + conversation_failures(
            check, bounds.max_abs_err, bounds.mean_abs_err, None)
        judged.setdefault(model_type, []).append((precision, forward, check, bounds, failures))
    return judged, reported_kernels(output), seconds


@pytest.mark.slow
@parametrize("arm", "model_type", sorted(TINY_BUILDERS), lambda t: t)
def test_every_family_runs_on_arm_kernels(families_on_arm, model_type):
    judged, kernels, seconds = families_on_arm
    assert kernels.get("fp16") == 1 and kernels.get("i8sdot") == 1  # MNN ran its ARM kernels
    assert [precision for precision, *_ in judged[model_type]][0] == "normal"
    for precision, forward, check, bounds, failures in judged[model_type]:
        print(f"\n{model_type} on ARM at {precision} ({seconds:.1f} s for all families): forward top-1 "
              f"{forward.top1_agreement:.0%}, max |dlogit| {forward.max_abs_err:.2e}; conversation max |dlogit| "
              f"{check.max_abs_err:.2e} (bound {bounds.max_abs_err})")
        assert len(forward.per_step) == 9 and len(check.turns) == 1 and check.runtime_error is None
        assert check.turns[0].prompt_ids_match and len(check.turns[0].oracle.greedy_mnn) >= 1
        assert failures == [], failures


# --- --verify_arm ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llama(tiny_decoder):
    return tiny_decoder("llama3")


@pytest.mark.slow
def test_cli_verify_arm_reports_both_precisions(llama, tmp_path):
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(llama), "--dst_path", str(dst), "--verify", "--verify_arm"])
    assert result.exit_code == 0, result.output
    print("\n" + next(line for line in result.output.splitlines() if line.startswith("verify: ")))
    assert "verify: PASS" in result.output and "ARM arm64" in result.output
    report = json.loads((dst / "verify.json").read_text())
    assert VerifyReport.read(dst / "verify.json").to_json() == report  # the arm section reads back
    arm_section = report["arm"]
    assert arm_section["kernels"]["fp16"] == 1 and arm_section["kernels"]["i8mm"] == 1
    # Llama ships fp16 activations (precision low): that run first and judged, normal beside it, judged too
    assert [(r["precision"], r["shipped"]) for r in arm_section["runs"]] == [("low", True), ("normal", False)]
    low, normal = arm_section["runs"]
    from llmexport.verification.arm import LOW_PRECISION_MAX_ABS_ERR

    assert low["failures"] == [] and normal["bound"] == report["bounds"]["max_abs_err"]
    assert low["bound"] == max(report["bounds"]["max_abs_err"], LOW_PRECISION_MAX_ABS_ERR)
    assert normal["failures"] == [] and normal["conversation"]["runtime_error"] is None
    assert len(normal["conversation"]["turns"]) == report["conversation"]["planned_turns"]
    # the shipped (fast) profile's int8 kernels: ARM's differ from x86's, within the same bounds
    assert 0 < normal["vs_host_max_abs_err"] < report["bounds"]["max_abs_err"]
    assert normal["oracle"]["max_abs_err"] < report["bounds"]["max_abs_err"]
    assert low["oracle"]["max_abs_err"] != normal["oracle"]["max_abs_err"]  # fp16 arithmetic ran


def test_verify_arm_without_the_emulator_is_one_line_and_writes_nothing(llama, tmp_path, monkeypatch):
    monkeypatch.setattr(machine.platform, "machine", lambda: "x86_64")
    monkeypatch.setenv(machine.QEMU_ENV, str(tmp_path / "missing-qemu"))
    dst = tmp_path / "out"
    result = CliRunner().invoke(main, ["--path", str(llama), "--dst_path", str(dst), "--verify", "--verify_arm"])
    assert result.exit_code == UsageError.exit_code
    lines = [line for line in result.output.splitlines() if line.startswith("llmexport: error:")]
    assert len(lines) == 1 and "qemu-user-static" in lines[0], result.output
    assert list(tmp_path.iterdir()) == []  # neither the destination nor a staging folder beside it


def test_verify_arm_needs_verify(llama, tmp_path):
    result = CliRunner().invoke(main, ["--path", str(llama), "--dst_path", str(tmp_path / "o"), "--verify_arm"])
    assert result.exit_code == UsageError.exit_code and "it needs --verify" in result.output


@pytest.mark.slow
def test_an_export_shipping_fp16_arithmetic_is_judged_on_arm_at_fp16_bounds(llama, tmp_path, arm):
    """x86 has no fp16 arithmetic (precision low runs as normal there). An fp16-record export that
    ships ``precision: low`` moves its logits on ARM past the fp16-record bound (so the ARM run is
    not vacuous: the host cannot show this), and is judged there at the bound of fp16 arithmetic,
    calibrated on correct exports; ``normal`` still proves the graph at the tight bound."""
    from llmexport.verification.arm import LOW_PRECISION_MAX_ABS_ERR, arm_failures
    from llmexport.verification.verify import summary_line, verify_export

    out = tmp_path / "out"
    export(llama, out, ExportOptions(quant=QuantScheme(16, 64), precision=Precision.LOW))
    assert json.loads((out / "config.json").read_text())["precision"] == "low"
    report = verify_export(out, llama, steps=8, arm=arm)
    print(f"\nshipping precision low: {summary_line(report)}")
    assert report.arm is not None and [r.precision for r in report.arm.runs] == ["low", "normal"]
    low, normal = report.arm.runs
    assert low.shipped and not normal.shipped and (low.bound, normal.bound) == (LOW_PRECISION_MAX_ABS_ERR,
                                                                                report.bounds.max_abs_err)
    assert report.oracle.max_abs_err < report.bounds.max_abs_err  # the host: low runs as normal
    assert normal.oracle.max_abs_err < report.bounds.max_abs_err < low.oracle.max_abs_err < LOW_PRECISION_MAX_ABS_ERR
    assert run_failures("", low.oracle, report.bounds.max_abs_err, None)  # the fp16-record bound would fail it
    assert report.passed and arm_failures(report.arm) == ()


def test_arm_failures_count_normal_always_and_low_where_shipped():
    from llmexport.results import ArmCheck, ArmPrecision
    from llmexport.verification.arm import arm_failures

    def run(precision, shipped):
        return ArmPrecision(precision, shipped, None, None, 0.0, None, (f"{precision} failed",), 1.0)  # type: ignore

    assert arm_failures(ArmCheck("m", {}, (run("normal", True), run("low", False)))) == ("normal failed",)
    assert arm_failures(ArmCheck("m", {}, (run("low", True), run("normal", False)))) == ("low failed", "normal failed")
