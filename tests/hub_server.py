"""A stand-in for the HuggingFace hub on the loopback address, for the tests of ``--path org/name``.

It answers the requests huggingface_hub 2.4 makes for ``snapshot_download`` (point it at the
server with ``HF_ENDPOINT``):

* ``GET /api/models/{repo}/revision/{rev}``: the repo's info, ``sha`` = the commit ``rev`` names;
* ``GET /api/models/{repo}/tree/{rev}``: the file list (one page);
* ``HEAD``/``GET /{repo}/resolve/{rev}/{file}``: the file, with ``ETag``, ``X-Repo-Commit`` and
  ``Content-Length``; ``Range: bytes=N-`` and ``bytes=A-B`` answered with 206;

and refuses as the hub does, with the ``X-Error-Code`` header huggingface_hub turns into its typed
errors: ``RepoNotFound`` (404), ``GatedRepo`` (401 without a token, 403 with a wrong one),
``RevisionNotFound`` (404), ``EntryNotFound`` (404). Every request is logged (method, path,
``Authorization``, ``Range``, body bytes sent) so tests can count what was downloaded.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

#: files served as LFS objects (the hub stores weights that way; huggingface_hub reads their sha256)
_LFS = (".safetensors", ".bin")


@dataclass
class Repo:
    """One model repo: its files at one commit, the branches and tags naming that commit, and its gate."""

    files: dict[str, bytes]
    commit: str = "0123456789abcdef0123456789abcdef01234567"
    refs: tuple[str, ...] = ("main",)
    token: str | None = None  # gated: only this bearer token may read it
    #: listed in the tree but answered 404 EntryNotFound (a file the hub lost, or a race with a push)
    lost: frozenset[str] = frozenset()

    @classmethod
    def from_folder(cls, folder: Path, extra: dict[str, bytes] | None = None, **kwargs) -> "Repo":
        files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
        return cls({**files, **(extra or {})}, **kwargs)


@dataclass
class Request:
    method: str
    path: str
    authorization: str | None
    range: str | None
    sent: int = 0  # body bytes written


@dataclass
class HubServer:
    """``with HubServer({"org/name": Repo(...)}) as hub: env["HF_ENDPOINT"] = hub.url``."""

    repos: dict[str, Repo]
    #: file name -> bytes after which the first GET of it drops the connection (then served normally)
    cut_after: dict[str, int] = field(default_factory=dict)
    requests: list[Request] = field(default_factory=list)

    def __enter__(self) -> "HubServer":
        hub = self

        class Handler(_Handler):
            server_state = hub

        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._httpd.server_address[1]}"

    def file_gets(self, name: str) -> list[Request]:
        return [r for r in self.requests if r.method == "GET" and "/resolve/" in r.path and r.path.endswith("/" + name)]

    def downloaded(self) -> dict[str, int]:
        """Body bytes served per file name (all GETs together)."""
        out: dict[str, int] = {}
        for r in self.requests:
            if r.method == "GET" and "/resolve/" in r.path:
                name = r.path.split("/resolve/", 1)[1].split("/", 1)[1]
                out[name] = out.get(name, 0) + r.sent
        return out


_API = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/.*)?")
_RESOLVE = re.compile(r"/(?P<repo>[^/]+/[^/]+)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")


class _Handler(BaseHTTPRequestHandler):
    server_state: HubServer

    def log_message(self, format, *args) -> None:  # quiet: the tests read HubServer.requests
        pass

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        record = Request(self.command, path, self.headers.get("Authorization"), self.headers.get("Range"))
        self.server_state.requests.append(record)
        api, resolve = _API.fullmatch(path), _RESOLVE.fullmatch(path)
        match = api or resolve
        repo = self.server_state.repos.get(match["repo"]) if match else None
        if match is None or repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.token is not None and record.authorization != f"Bearer {repo.token}":
            return self._error(401 if record.authorization is None else 403, "GatedRepo",
                               "Access to this model is restricted; you must have access to it and be authenticated")
        if match["rev"] not in (*repo.refs, repo.commit):
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {match['rev']}")
        if api is not None:
            return self._json(self._info(match["repo"], repo) if api["kind"] == "revision" else self._tree(repo))
        self._file(repo, resolve["file"], record, body)

    def _info(self, repo_id: str, repo: Repo) -> dict:
        return {"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": False,
                "gated": "manual" if repo.token else False, "siblings": [{"rfilename": f} for f in sorted(repo.files)]}

    def _tree(self, repo: Repo) -> list[dict]:
        entries = []
        for name, data in sorted(repo.files.items()):
            entry = {"type": "file", "oid": hashlib.sha1(data).hexdigest(), "size": len(data), "path": name}
            if name.endswith(_LFS):
                entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
            entries.append(entry)
        return entries

    def _file(self, repo: Repo, name: str, record: Request, body: bool) -> None:
        if name not in repo.files or name in repo.lost:
            return self._error(404, "EntryNotFound", f"{name} does not exist on \"{repo.refs[0]}\"")
        data = repo.files[name]
        start, end = 0, len(data)
        if record.range is not None:  # bytes=N- (a resumed download), bytes=A-B (a header read for a plan)
            first, last = re.fullmatch(r"bytes=(\d+)-(\d*)", record.range).groups()
            start, end = int(first), min(len(data), int(last) + 1 if last else len(data))
        self.send_response(206 if record.range is not None else 200)
        etag = hashlib.sha256(data).hexdigest() if name.endswith(_LFS) else hashlib.sha1(data).hexdigest()
        self.send_header("ETag", f'"{etag}"')
        self.send_header("X-Repo-Commit", repo.commit)
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(end - start))
        if record.range is not None:
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{len(data)}")
        self.end_headers()
        if not body:
            return
        cut = self.server_state.cut_after.pop(name, None)
        chunk = data[start:end] if cut is None else data[start:start + cut]
        self.wfile.write(chunk)
        record.sent = len(chunk)
        if cut is not None:  # drop the connection mid-body, as a flaky network does
            self.wfile.flush()
            self.close_connection = True

    def _json(self, value) -> None:
        data = json.dumps(value).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)

    def _error(self, status: int, code: str, message: str) -> None:
        data = json.dumps({"error": message}).encode()
        self.send_response(status)
        self.send_header("X-Error-Code", code)
        self.send_header("X-Error-Message", message)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)
