"""A Hugging Face Hub-compatible HTTP server on loopback for tests: the endpoints and headers the real
`huggingface_hub` client's snapshot_download uses (repo info, tree listing, file HEAD/GET), serving repos held in
memory, and a record of the requests it saw."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit


@dataclass(slots=True)
class Repo:
    """Branches and tags (names -> commits) and each commit's files (path -> bytes)."""

    refs: dict[str, str] = field(default_factory=dict)
    commits: dict[str, dict[str, bytes]] = field(default_factory=dict)

    def add_commit(self, ref: str, files: dict[str, bytes]) -> str:
        """A new commit holding `files`, which `ref` then points at; returns its hash."""
        commit = hashlib.sha1(repr((ref, len(self.commits), sorted(files))).encode()).hexdigest()
        self.commits[commit] = dict(files)
        self.refs[ref] = commit
        return commit


@dataclass(frozen=True, slots=True)
class Seen:
    method: str
    path: str
    authorization: str | None


def files_of(directory: str | Path) -> dict[str, bytes]:
    """Every file under `directory`, by its path relative to it (as a repo holds them)."""
    root = Path(directory)
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


class FakeHub:
    """`with FakeHub() as hub:` serves `hub.repos` at `hub.url`; `hub.seen` lists the requests."""

    def __init__(self) -> None:
        self.repos: dict[str, Repo] = {}
        self.seen: list[Seen] = []
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> FakeHub:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._server.shutdown()
            self._thread.join(timeout=30)
        self._server.server_close()

    def requests_for(self, repo_id: str) -> list[Seen]:
        return [s for s in self.seen if f"/{repo_id}/" in s.path]

    # -- what each endpoint answers: (status, headers, body) ---------------------------------------------------
    def answer(self, method: str, path: str) -> tuple[int, dict[str, str], bytes]:
        parts = [unquote(p) for p in urlsplit(path).path.strip("/").split("/")]
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            repo, commit, error = self._lookup(repo_id, rev)
            if error:
                return error
            files = repo.commits[commit]
            if kind == "revision":
                return _json({"id": repo_id, "sha": commit, "private": False,
                              "siblings": [{"rfilename": f} for f in sorted(files)]})
            return _json([_tree_entry(f, data) for f, data in sorted(files.items())])
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, filename = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            repo, commit, error = self._lookup(repo_id, rev)
            if error:
                return error
            data = repo.commits[commit].get(filename)
            if data is None:
                return 404, {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": commit}, b"Entry not found"
            headers = {"X-Repo-Commit": commit, "ETag": f'"{hashlib.sha256(data).hexdigest()}"',
                       "Content-Type": "application/octet-stream"}
            return 200, headers, data
        return 404, {}, b"not found"

    def _lookup(self, repo_id: str, rev: str):
        repo = self.repos.get(repo_id)
        if repo is None:
            return None, None, (404, {"X-Error-Code": "RepoNotFound"}, b"Repository not found")
        commit = repo.refs.get(rev, rev)
        if commit not in repo.commits:
            return repo, None, (404, {"X-Error-Code": "RevisionNotFound"}, b"Invalid rev id")
        return repo, commit, None


def _tree_entry(path: str, data: bytes) -> dict:
    entry = {"type": "file", "path": path, "size": len(data),
             "oid": hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()}
    if path.endswith((".safetensors", ".bin")):  # as the Hub lists LFS files
        entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data), "pointerSize": 134}
    return entry


def _json(value) -> tuple[int, dict[str, str], bytes]:
    return 200, {"Content-Type": "application/json"}, json.dumps(value).encode()


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def _serve(self, body_too: bool) -> None:
            hub.seen.append(Seen(self.command, self.path, self.headers.get("authorization")))
            status, headers, body = hub.answer(self.command, self.path)
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            # NOTE: no keep-alive: a handler thread serving a kept connection would outlive close()
            self.send_header("Connection", "close")
            self.close_connection = True
            self.end_headers()
            if body_too:
                self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's names)
            self._serve(body_too=True)

        def do_HEAD(self) -> None:  # noqa: N802
            self._serve(body_too=False)

        def log_message(self, *args) -> None:  # quiet: the test reads `hub.seen`
            pass

    return Handler
