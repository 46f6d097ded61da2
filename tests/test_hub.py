"""``--path org/name``: hub repos fetched through huggingface_hub, against the stand-in hub of
tests/hub_server.py on 127.0.0.1 (``HF_ENDPOINT``); nothing here reaches the internet.

huggingface_hub reads ``HF_ENDPOINT``, ``HF_HOME`` and ``HF_HUB_OFFLINE`` once, when it is
imported, so every download runs in a child process with its own environment (``_clean_env``
drops whatever HF_* settings the test run itself has).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from gguf_fixtures import split_gguf, tiny_gguf
from hub_server import HubServer, Repo

from llmexport.errors import InputError, UsageError
from llmexport.source.hub import ModelSource, is_repo_id, resolve_source

ROOT = Path(__file__).resolve().parents[1]
#: what the export reads of the tiny Llama checkpoint (all of its files)
READ = ["chat_template.jinja", "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
        "tokenizer_config.json"]
#: what a real repo carries beside them and the export never reads
DECOYS = {"pytorch_model.bin": b"pickle" * 100, "original/consolidated.safetensors": b"copy" * 100,
          "README.md": b"# tiny\n", "onnx/model.onnx": b"onnx" * 10}

_RESOLVE = """
import hashlib, json, sys
import huggingface_hub.constants as constants
if sys.argv[3]:  # huggingface_hub resumes from the last whole chunk it wrote (10 MiB): smaller for tiny files
    constants.DOWNLOAD_CHUNK_SIZE = int(sys.argv[3])
from llmexport.errors import LlmExportError
from llmexport.source.hub import planning_folder, resolve_source
try:
    if sys.argv[4] == "plan":  # the folder --dry-run plans from: its files and their sizes, while it exists
        with planning_folder(sys.argv[1], sys.argv[2] or None, quiet=True) as folder:
            print(json.dumps({"folder": str(folder), "sha256": {p.relative_to(folder).as_posix():
                              hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*"))}}))
        sys.exit(0)
    source = resolve_source(sys.argv[1], sys.argv[2] or None, quiet=True, gguf_file=sys.argv[5] or None)
except LlmExportError as exc:
    print(exc, file=sys.stderr)
    sys.exit(exc.exit_code)
print(json.dumps({"folder": str(source.folder), "manifest": source.manifest(),
                  "files": sorted(p.relative_to(source.folder).as_posix() for p in source.folder.rglob("*"))}))
"""


def _clean_env(hub_url: str, home: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "HUGGINGFACE", "TRANSFORMERS_")) and "proxy" not in k.lower()}
    env.update(HF_ENDPOINT=hub_url, HF_HOME=str(home), PYTHONPATH=str(ROOT), NO_PROXY="127.0.0.1",
               HF_HUB_DISABLE_TELEMETRY="1", **extra)
    return env


def _resolve(env: dict[str, str], path: str, revision: str = "", chunk: int = 0, mode: str = "export",
             gguf_file: str = "") -> tuple[int, dict, str]:
    proc = subprocess.run([sys.executable, "-c", _RESOLVE, path, revision, str(chunk or ""), mode, gguf_file], env=env,
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout) if proc.returncode == 0 else {}, proc.stderr.strip()


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from llmexport.cli import main; main()", *args], env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def tiny(tiny_decoder) -> Path:
    return tiny_decoder("llama3")


def test_repo_id_grammar():
    for good in ("google/gemma-4-E2B-it", "Qwen/Qwen3-0.6B", "org/name", "a/b", "meta-llama/Llama-3.2-1B_v2.1"):
        assert is_repo_id(good), good
    for bad in ("name", "org/name/extra", "/abs/path", "./org/name", "org/", "/name", "org--x/name", "org/na..me",
                "org/-name", "org/name-", "~/models", "org/na me", "C:\\models\\x", "org/" + "n" * 97):
        assert not is_repo_id(bad), bad


def test_a_local_path_wins_and_a_missing_one_says_what_was_expected(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "name").mkdir(parents=True)
    # an existing folder is read as it is, even when it looks like a repo id: nothing is fetched
    assert resolve_source("org/name") == ModelSource(Path("org/name"))
    assert resolve_source("org/name").manifest() is None
    with pytest.raises(UsageError, match=r"^--revision v1: applies to a hub repo id; --path org/name is a local"):
        resolve_source("org/name", "v1")
    with pytest.raises(InputError, match=r"^models/x/y: model path does not exist \(nor is it a hub repo id"):
        resolve_source("models/x/y")


def test_a_refused_destination_is_refused_before_any_download(tmp_path, monkeypatch):
    """--dst_path the current folder: exit 2 at once, the hub never asked."""
    import llmexport

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("llmexport.source.hub.resolve_source",
                        lambda *args: pytest.fail("fetched before --dst_path's checks"))
    with pytest.raises(UsageError, match=r"^--dst_path \.: is the current folder"):
        llmexport.export("org/never-fetched", ".")
    assert list(tmp_path.iterdir()) == []


def test_downloads_only_what_the_export_reads(tiny, tmp_path):
    with HubServer({"org/tiny": Repo.from_folder(tiny, DECOYS)}) as hub:
        rc, out, err = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/tiny")
    assert rc == 0, err
    assert out["files"] == READ
    # HF_HOME relocates the cache; the snapshot is named by the commit, which the manifest records
    folder = Path(out["folder"])
    assert folder.parent.parent == tmp_path / "hf" / "hub" / "models--org--tiny" and folder.name == Repo.commit
    assert out["manifest"] == {"repo_id": "org/tiny", "revision": "main", "commit": Repo.commit}
    assert sorted(hub.downloaded()) == READ  # the pickle, the copy in original/, the README: never asked for
    assert [name for name in READ if (folder / name).read_bytes() != (tiny / name).read_bytes()] == []
    assert all(r.authorization is None for r in hub.requests)  # no token set, none sent


def test_sharded_repo_fetches_the_shards_its_index_names(tiny, tmp_path):
    """A repo's index picks the shards: a top-level ``consolidated.safetensors`` beside them (as
    Mistral's repos ship) is not fetched; a shard the index names but the repo lacks is an error."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(tiny / "model.safetensors")
    names = sorted(tensors)
    repo = tmp_path / "sharded"
    repo.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (repo / name).write_bytes((tiny / name).read_bytes())
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, repo / shard)
    (repo / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    (repo / "consolidated.safetensors").write_bytes((tiny / "model.safetensors").read_bytes())
    with HubServer({"org/sharded": Repo.from_folder(repo),
                    "org/lost-shard": Repo.from_folder(repo, lost=frozenset({"model-00002-of-00002.safetensors"})),
                    }) as hub:
        (repo / "model-00002-of-00002.safetensors").unlink()
        hub.repos["org/unlisted-shard"] = Repo.from_folder(repo)
        rc, out, err = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/sharded")
        assert rc == 0, err
        assert out["files"] == ["config.json", *halves, "model.safetensors.index.json", "tokenizer.json",
                                "tokenizer_config.json"]
        assert "consolidated.safetensors" not in hub.downloaded()
        unlisted = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/unlisted-shard")
        unlisted_plan = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/unlisted-shard", mode="plan")
        index = json.loads((repo / "model.safetensors.index.json").read_text())
        index["weight_map"] = {k: "../../escape.safetensors" for k in index["weight_map"]}
        hub.repos["org/escaping"] = Repo.from_folder(repo, {"model.safetensors.index.json": json.dumps(index).encode()})
        escaping_plan = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/escaping", mode="plan")
        rc, _, err = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/lost-shard")
    assert unlisted[0] == 3 and unlisted[2] == (
        "--path org/unlisted-shard: model-00002-of-00002.safetensors, named in model.safetensors.index.json, is not "
        f"in the repo at commit {Repo.commit}")
    assert unlisted_plan[0] == 3 and unlisted_plan[2] == unlisted[2]  # --dry-run: the same, before any request
    assert escaping_plan[0] == 3 and escaping_plan[2].startswith("--path org/escaping: ../../escape.safetensors, named")
    assert not (tmp_path.parent / "escape.safetensors").exists() and not (tmp_path / "escape.safetensors").exists()
    assert rc == 3 and err.startswith("--path org/lost-shard: a file the repo lists is missing on the hub (") \
        and "model-00002-of-00002.safetensors" in err and len(err.splitlines()) == 1, err


def test_missing_file_repo_and_pickles_only(tiny, tmp_path):
    pickles = {"config.json": (tiny / "config.json").read_bytes(), "pytorch_model.bin": b"pickle" * 10}
    with HubServer({"org/lost": Repo.from_folder(tiny, lost=frozenset({"tokenizer.json"})),
                    "org/pickles": Repo(pickles)}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf")
        lost = _resolve(env, "org/lost")
        gone = _resolve(env, "org/nowhere")
        only_pickles = _resolve(env, "org/pickles")
        assert not hub.file_gets("pytorch_model.bin")  # named in the error, never downloaded
    assert lost[0] == 3 and lost[2] == (f"--path org/lost: a file the repo lists is missing on the hub ({hub.url}"
                                        f"/org/lost/resolve/{Repo.commit}/tokenizer.json)")
    assert gone[0] == 3 and gone[2] == (f"--path org/nowhere: not a local folder, and no such model repo on {hub.url} "
                                        "(or it is private: set HF_TOKEN to a token that can read it)")
    assert only_pickles[0] == 3 and only_pickles[2] == (
        "--path org/pickles: the repo has only pickle weights (pytorch_model.bin); llmexport reads *.safetensors "
        "and never unpickles (convert them to safetensors first)")


def test_revisions(tiny, tmp_path):
    """A tag resolves to its commit (recorded in the manifest); a commit id is used as it is; a
    revision the repo does not have is a one-line error naming --revision."""
    with HubServer({"org/tiny": Repo.from_folder(tiny, refs=("main", "v1.0"))}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf")
        tag = _resolve(env, "org/tiny", "v1.0")
        commit = _resolve(env, "org/tiny", Repo.commit)
        missing = _resolve(env, "org/tiny", "v9")
    assert tag[0] == 0 and tag[1]["manifest"] == {"repo_id": "org/tiny", "revision": "v1.0", "commit": Repo.commit}
    assert commit[0] == 0 and commit[1]["manifest"]["commit"] == Repo.commit
    assert missing[0] == 3 and missing[2] == "--revision v9: org/tiny has no such branch, tag or commit"


def test_gated_repo_needs_hf_token(tiny, tmp_path):
    gated = Repo.from_folder(tiny, token="hf_test_token")
    dst = tmp_path / "out"
    with HubServer({"org/gated": gated}) as hub:
        refused = _cli(_clean_env(hub.url, tmp_path / "hf"), "--path", "org/gated", "--dst_path", str(dst))
        assert hub.requests and not hub.downloaded()
        hub.requests.clear()
        rc, out, err = _resolve(_clean_env(hub.url, tmp_path / "hf", HF_TOKEN="hf_test_token"), "org/gated")
        assert rc == 0, err
        assert out["files"] == READ
        # HF_TOKEN reached the hub as the bearer token of every request
        assert hub.requests and {r.authorization for r in hub.requests} == {"Bearer hf_test_token"}
    assert refused.returncode == 3 and refused.stdout == ""
    assert refused.stderr.strip() == (f"llmexport: error: --path org/gated: gated repo on {hub.url}; accept its "
                                      "conditions on its page and set HF_TOKEN (or run `hf auth login`) with a token "
                                      "that has access")
    assert not dst.exists() and not list(tmp_path.glob(".out.*"))


def test_offline_uses_the_cached_snapshot(tiny, tmp_path):
    with HubServer({"org/tiny": Repo.from_folder(tiny)}) as hub:
        online = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/tiny")
        hub.requests.clear()
        offline = _resolve(_clean_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"), "org/tiny")
        assert online[0] == 0 and offline[0] == 0, offline[2]
        assert offline[1] == online[1] and not hub.requests  # the same snapshot, and not a single request
        dst = tmp_path / "out"
        uncached = _cli(_clean_env(hub.url, tmp_path / "empty", HF_HUB_OFFLINE="1"), "--path", "org/tiny",
                        "--dst_path", str(dst), "--quiet")
        assert not hub.requests
    assert uncached.returncode == 3 and uncached.stderr.strip() == (
        "llmexport: error: --path org/tiny: HF_HUB_OFFLINE is set and no complete cached snapshot is in "
        f"{tmp_path / 'empty' / 'hub'}; run once online (or unset HF_HUB_OFFLINE)")
    assert not dst.exists()


def test_a_cut_connection_resumes_where_it_stopped(tiny, tmp_path):
    """The hub drops the connection 200,000 bytes into the weights: huggingface_hub asks for the
    rest with a Range request from the last whole chunk it wrote (64 KiB here), within the same run."""
    size = (tiny / "model.safetensors").stat().st_size
    chunk = 64 << 10
    with HubServer({"org/tiny": Repo.from_folder(tiny)}, cut_after={"model.safetensors": 200_000}) as hub:
        rc, out, err = _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/tiny", chunk=chunk)
        gets = hub.file_gets("model.safetensors")
    assert rc == 0, err
    resumed_at = 200_000 // chunk * chunk
    assert [(g.range, g.sent) for g in gets] == [(None, 200_000), (f"bytes={resumed_at}-", size - resumed_at)]
    assert (Path(out["folder"]) / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()


def test_a_failed_run_leaves_finished_files_for_the_next(tiny, tmp_path):
    """A run that stopped on the weights (here: the hub lost them) keeps the files it finished in
    the cache: the next run downloads only the weights."""
    with HubServer({"org/tiny": Repo.from_folder(tiny, lost=frozenset({"model.safetensors"}))}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf")
        assert _resolve(env, "org/tiny")[0] == 3
        hub.repos["org/tiny"].lost = frozenset()
        hub.requests.clear()
        rc, _, err = _resolve(env, "org/tiny")
        assert rc == 0, err
        assert hub.downloaded() == {"model.safetensors": (tiny / "model.safetensors").stat().st_size}


@pytest.mark.slow
def test_hub_export_matches_the_folder_export(tiny, tmp_path):
    """The CLI on a hub id, through a cut connection, then offline from the cache: the same files
    as an export of the folder, and a manifest naming the repo and commit."""
    from llmexport.planning.digests import file_sha256

    chunk_patch = "import huggingface_hub.constants as c; c.DOWNLOAD_CHUNK_SIZE = 1 << 16; "
    with HubServer({"org/tiny": Repo.from_folder(tiny, DECOYS)}, cut_after={"model.safetensors": 150_000}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf")
        proc = subprocess.run([sys.executable, "-c", chunk_patch + "from llmexport.cli import main; main()",
                               "--path", "org/tiny", "--dst_path", str(tmp_path / "hub"), "--quant_bit", "8"],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert [g.range for g in hub.file_gets("model.safetensors")] == [None, "bytes=131072-"]
        hub.requests.clear()
        # offline, the cached snapshot exports the same, without a request
        offline = _cli(_clean_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"), "--path", "org/tiny", "--dst_path",
                       str(tmp_path / "offline"), "--quant_bit", "8", "--quiet")
        assert offline.returncode == 0 and offline.stderr == "", offline.stderr[-2000:]
        assert not hub.requests
    local = _cli(env, "--path", str(tiny), "--dst_path", str(tmp_path / "local"), "--quant_bit", "8", "--quiet")
    assert local.returncode == 0, local.stderr[-2000:]
    hashes = {p.name: file_sha256(p) for p in (tmp_path / "hub").iterdir() if p.name != "manifest.json"}
    assert hashes == {p.name: file_sha256(p) for p in (tmp_path / "local").iterdir() if p.name != "manifest.json"}
    assert hashes == {p.name: file_sha256(p) for p in (tmp_path / "offline").iterdir() if p.name != "manifest.json"}
    manifest = json.loads((tmp_path / "hub" / "manifest.json").read_text())
    local_manifest = json.loads((tmp_path / "local" / "manifest.json").read_text())
    assert manifest.pop("source") == {"repo_id": "org/tiny", "revision": "main", "commit": Repo.commit}
    assert manifest == local_manifest and "source" not in local_manifest


def test_a_repo_of_gguf_files_fetches_only_the_file_named(tmp_path):
    """A repo of quantizations (bartowski's, unsloth's layout): without --gguf_file an error lists
    them; with it only that file (every part of a split model) is fetched, and the manifest names it."""
    first = split_gguf("llama", "q8_0", 12)
    files = {"tiny-Q8_0.gguf": tiny_gguf("llama", "q8_0").read_bytes(), "tiny-Q4_1.gguf":
             tiny_gguf("llama", "Q4_1").read_bytes(), "README.md": b"# GGUF\n",
             **{f"split/{p.name}": p.read_bytes() for p in sorted(first.parent.glob("model-*.gguf"))}}
    env = _clean_env("", tmp_path / "hf", LLMEXPORT_GGUF_CACHE=str(tmp_path / "views"))
    with HubServer({"org/tiny-GGUF": Repo(files)}) as hub:
        env["HF_ENDPOINT"] = hub.url
        rc, _, err = _resolve(env, "org/tiny-GGUF")
        assert rc == InputError.exit_code and err == (
            "--path org/tiny-GGUF: a repo of GGUF files (split/model-00001-of-00004.gguf, tiny-Q4_1.gguf, "
            "tiny-Q8_0.gguf); "
            "name the one to export with --gguf_file")
        hub.requests.clear()
        rc, out, err = _resolve(env, "org/tiny-GGUF", gguf_file="tiny-Q4_1.gguf")
        assert rc == 0, err
        assert sorted(hub.downloaded()) == ["tiny-Q4_1.gguf"]
        assert out["manifest"] == {"repo_id": "org/tiny-GGUF", "revision": "main", "commit": Repo.commit,
                                   "gguf_file": "tiny-Q4_1.gguf"}
        assert "config.json" in out["files"] and Path(out["folder"]).parent == tmp_path / "views"
        hub.requests.clear()
        rc, out, err = _resolve(env, "org/tiny-GGUF", gguf_file="split/model-00001-of-00004.gguf")
        assert rc == 0, err
        assert sorted(hub.downloaded()) == [f"split/model-0000{i}-of-00004.gguf" for i in range(1, 5)]
        rc, _, err = _resolve(env, "org/tiny-GGUF", gguf_file="tiny-Q6_K.gguf")
        assert rc == InputError.exit_code and err.startswith(
            f"--path org/tiny-GGUF (commit {Repo.commit}): no GGUF file tiny-Q6_K.gguf (its GGUF files: ")


def test_revision_flag_reaches_the_options_not_the_options_manifest():
    from llmexport.cli import export_options, parse_command
    from llmexport.options import ExportOptions

    options = export_options(parse_command(["--path", "org/x", "--dst_path", "y", "--revision", "v1.0"]))
    assert options.revision == "v1.0" and options.validate() is options
    assert "revision" not in options.manifest_fields()  # manifest.json's "source" holds it, beside the commit
    assert export_options(parse_command(["--path", "org/x", "--dst_path", "y"])).revision is None
    with pytest.raises(UsageError, match=r"^--revision: must name a branch, tag or commit"):
        ExportOptions(revision=" ").validate()


def test_dry_run_reads_weight_headers_only(tiny, tmp_path):
    """--dry-run on a hub id downloads the small files and reads each weight file's header with
    two Range requests into a stand-in folder: header, then a hole to the file's size. A folder
    like that plans exactly as the real one; no weight bytes are fetched."""
    weights = (tiny / "model.safetensors").read_bytes()
    header = 8 + int.from_bytes(weights[:8], "little")
    stand_in = weights[:header] + bytes(len(weights) - header)
    with HubServer({"org/tiny": Repo.from_folder(tiny, DECOYS)}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf", TMPDIR=str(tmp_path))
        rc, out, err = _resolve(env, "org/tiny", mode="plan")
        assert rc == 0, err
        assert [(g.range, g.sent) for g in hub.file_gets("model.safetensors")] == [
            ("bytes=0-7", 8), (f"bytes=8-{header - 1}", header - 8)]
        assert sorted(hub.downloaded()) == READ  # the weights' header only; never the pickle
        expected = {name: hashlib.sha256((tiny / name).read_bytes()).hexdigest() for name in READ}
        assert out["sha256"] == {**expected, "model.safetensors": hashlib.sha256(stand_in).hexdigest()}
        assert not Path(out["folder"]).exists() and not list(tmp_path.glob("llmexport-plan-*"))  # removed after
        # offline, a snapshot without its weights cannot be planned: the error says what is missing
        offline = _resolve(_clean_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"), "org/tiny", mode="plan")
        assert offline[0] == 3 and offline[2].startswith("--path org/tiny: HF_HUB_OFFLINE is set and the cached "
                                                         "snapshot in ") and "lacks model.safetensors" in offline[2]
        # once the weights are cached, the plan reads the snapshot itself, online or not
        assert _resolve(env, "org/tiny")[0] == 0
        hub.requests.clear()
        cached = _resolve(_clean_env(hub.url, tmp_path / "hf", HF_HUB_OFFLINE="1"), "org/tiny", mode="plan")
        assert cached[0] == 0 and Path(cached[1]["folder"]).parent.name == "snapshots" and not hub.requests
    # the stand-in's bytes plan as the checkpoint does (the plan reads headers and sizes only)
    import llmexport

    folder = tmp_path / "stand-in"
    folder.mkdir()
    for name in READ:
        (folder / name).write_bytes(stand_in if name == "model.safetensors" else (tiny / name).read_bytes())
    options = llmexport.ExportOptions(quiet=True)
    assert llmexport.plan(folder, options) == llmexport.plan(tiny, options)


def test_remote_code_the_config_names_is_fetched(tiny, tmp_path):
    """A remote-code family's reference (run by --verify --trust_remote_code only) is the modules
    config.json's auto_map names; other code in the repo is not fetched."""
    config = json.loads((tiny / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "configuration_x.XConfig", "AutoModelForCausalLM": "modeling_x.XModel",
                          "AutoTokenizer": ["tokenization_x.XTokenizer", None], "AutoModel": "other/repo--m.Model"}
    code = {name: b"# code\n" for name in ("configuration_x.py", "modeling_x.py", "tokenization_x.py", "train.py")}
    no_config = {"model.safetensors": (tiny / "model.safetensors").read_bytes()}
    with HubServer({"org/code": Repo.from_folder(tiny, {**code, "config.json": json.dumps(config).encode()}),
                    "org/no-config": Repo(no_config)}) as hub:
        env = _clean_env(hub.url, tmp_path / "hf")
        rc, out, err = _resolve(env, "org/code")
        missing = _resolve(env, "org/no-config")
        assert not hub.file_gets("model.safetensors")[1:]  # the repo without a config: its weights never fetched
    assert rc == 0, err
    assert out["files"] == sorted([*READ, "configuration_x.py", "modeling_x.py", "tokenization_x.py"])
    assert missing[0] == 3 and missing[2] == (f"--path org/no-config: the repo has no config.json at commit "
                                              f"{Repo.commit} (expected a transformers checkpoint)")


def test_unreachable_hub_falls_back_to_the_cache(tiny, tmp_path):
    with HubServer({"org/tiny": Repo.from_folder(tiny)}) as hub:
        assert _resolve(_clean_env(hub.url, tmp_path / "hf"), "org/tiny")[0] == 0
        url = hub.url
    # the server is gone: huggingface_hub uses the cached snapshot of main; with no cache, the error says why
    cached = _resolve(_clean_env(url, tmp_path / "hf"), "org/tiny")
    uncached = _resolve(_clean_env(url, tmp_path / "empty"), "org/tiny")
    assert cached[0] == 0 and cached[1]["files"] == READ
    assert uncached[0] == 3 and uncached[2].startswith("--path org/tiny: the hub cannot be reached (") \
        and uncached[2].endswith(f"and no complete cached snapshot is in {tmp_path / 'empty' / 'hub'}"), uncached[2]


def test_progress_bars_on_a_terminal_unless_quiet(tiny, tmp_path):
    """huggingface_hub's bars are drawn when stderr is a terminal, and not with quiet (in CI logs,
    stderr not a terminal, there are none: the CLI tests above read one line)."""
    import fcntl
    import pty
    import struct
    import termios

    def stderr_on_a_terminal(quiet: bool) -> str:
        with HubServer({"org/tiny": Repo.from_folder(tiny)}) as hub:
            master, slave = pty.openpty()
            fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # a width for the bars
            code = ("import sys; from llmexport.source.hub import resolve_source; "
                    "resolve_source('org/tiny', quiet=%s)" % quiet)
            proc = subprocess.run([sys.executable, "-c", code], env=_clean_env(hub.url, tmp_path / str(quiet)),
                                  stderr=slave, timeout=120)
            os.close(slave)
            out = b""
            try:
                while chunk := os.read(master, 1 << 16):
                    out += chunk
            except OSError:  # the terminal's other end is closed: all read
                pass
            os.close(master)
            assert proc.returncode == 0
            return out.decode(errors="replace")

    drawn = stderr_on_a_terminal(False)
    assert "Download complete" in drawn and "100%|" in drawn, drawn
    assert stderr_on_a_terminal(True) == ""
