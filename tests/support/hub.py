"""A model hub on loopback that answers as the Hugging Face Hub does, as huggingface_hub 2.x reads it."""

from __future__ import annotations

import hashlib
import json
import re
import select
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from harness.waits import free_port
from tests.support.hub_repos import Blob, Busy, Repo, Request, blob_fields, entry, folder_entry, tree


class LoopbackHub:
    """Repositories published from local folders, served on 127.0.0.1 (hub and CDN origins)."""

    def __init__(
        self, tokens: tuple[str, ...] = (), *, siblings: bool = True, cdn: bool = True, ranges: bool = True
    ) -> None:
        """``tokens``: the tokens with access to gated and private repositories. A more minimal hub:
        ``siblings=False`` leaves the file list out of repo info (the tree still lists it);
        ``cdn=False`` serves LFS files at their resolve URL instead of redirecting to the CDN;
        ``ranges=False`` answers a ranged GET with the whole file (200), as some mirrors and proxies do."""
        self.repos: dict[str, Repo] = {}
        self.tokens = set(tokens)
        self.siblings, self.use_cdn, self.ranges = siblings, cdn, ranges
        #: file → bytes after which the next ranged GET of it asking for more is cut (the connection drops)
        self.cuts: dict[str, int] = {}
        #: file → the byte from which its ranged GETs are never answered (recorded with status 0)
        self.stalls: dict[str, int] = {}
        #: "try later" answers still to give, in order
        self.busy: list[Busy] = []
        self.stopped = threading.Event()
        self.requests: list[Request] = []
        self.lock = threading.Lock()
        self.port = free_port()
        self.cdn_port = free_port()
        self._servers: list[ThreadingHTTPServer] = []
        self._conns: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    # --- content ------------------------------------------------------------
    def publish(self, repo_id: str, folder: Path, *, tag: str | None = None, **flags: bool) -> str:
        """A new commit of ``repo_id`` holding ``folder``'s files, on ``main`` (and ``tag``); returns its sha."""
        repo = self.repos.setdefault(repo_id, Repo(repo_id))
        for k, v in flags.items():
            setattr(repo, k, v)
        files = {str(p.relative_to(folder)): Blob.of(p) for p in sorted(folder.rglob("*")) if p.is_file()}
        listing = json.dumps([repo_id, len(repo.commits), {k: b.git_sha1 for k, b in files.items()}])
        sha = hashlib.sha1(listing.encode()).hexdigest()
        repo.commits[sha] = files
        repo.refs["main"] = sha
        if tag:
            repo.refs[tag] = sha
        return sha

    def env(self, home: Path, **extra: str) -> dict[str, str]:
        """The environment of a process that uses this hub, with its Hugging Face cache under ``home``
        (and no token, no offline mode inherited from the caller's)."""
        return {
            "HF_ENDPOINT": self.url,
            "HF_HOME": str(home),
            "HF_HUB_CACHE": str(home / "hub"),
            "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0",
            "HF_TOKEN": "",
            **extra,
        }

    def served(self, file: str | None = None, origin: str | None = None) -> list[Request]:
        with self.lock:
            return [r for r in self.requests if (file is None or r.file == file) and origin in (None, r.origin)]

    def bytes_sent(self, file: str | None = None) -> int:
        return sum(r.sent for r in self.served(file))

    def reset(self) -> None:
        with self.lock:
            self.requests.clear()

    # --- lifecycle ----------------------------------------------------------
    def start(self) -> LoopbackHub:
        self.stopped.clear()
        for port, origin in ((self.port, "hub"), (self.cdn_port, "cdn")):
            server = ThreadingHTTPServer(("127.0.0.1", port), _handler(self, origin))
            server.daemon_threads = True
            threading.Thread(target=server.serve_forever, daemon=True, name=f"loopback-{origin}").start()
            self._servers.append(server)
        return self

    def stop(self) -> None:
        """No answer any more: listening sockets closed, open connections cut."""
        self.stopped.set()
        for server in self._servers:
            server.shutdown()
            server.server_close()
        self._servers.clear()
        with self.lock:
            for conn in self._conns:
                try:
                    conn.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._conns.clear()

    def __enter__(self) -> LoopbackHub:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _handler(hub: LoopbackHub, origin: str) -> type[BaseHTTPRequestHandler]:
    class Handler(_Handler):
        pass

    Handler.hub, Handler.origin = hub, origin
    return Handler


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: LoopbackHub
    origin: str

    def setup(self) -> None:
        super().setup()
        with self.hub.lock:
            self.hub._conns.add(self.connection)

    def finish(self) -> None:
        with self.hub.lock:
            self.hub._conns.discard(self.connection)
        super().finish()

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def client_gone(self) -> bool:
        """Whether the client closed the connection (its end reads as closed)."""
        readable, _, _ = select.select([self.connection], [], [], 0)
        try:
            return bool(readable) and not self.connection.recv(1, socket.MSG_PEEK)
        except OSError:
            return True

    # --- answers ------------------------------------------------------------
    def answer(self, status: int, body: bytes = b"", file: str | None = None, **headers: str) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        self.send_header("Content-Length", str(len(body)))
        sent = 0 if self.command == "HEAD" else len(body)
        byte_range = None
        if status == 206:
            start, _, end = headers["Content_Range"].split()[1].partition("/")[0].partition("-")
            byte_range = (int(start), int(end) + 1)
        with self.hub.lock:  # recorded before the answer goes out: a caller that has it sees the record
            self.hub.requests.append(Request(self.origin, self.command, self.path, file, byte_range, sent, status))
        self.end_headers()
        if sent:
            self.wfile.write(body)

    def try_later(self, file: str | None) -> bool:
        """Whether this request got the first ``busy`` answer it matches (``file``: the file it asks for)."""
        m = re.match(r"bytes=(\d+)-", self.headers.get("Range") or "")
        start = int(m.group(1)) if m else None
        with self.hub.lock:
            for busy in self.hub.busy:
                mine = busy.origin in (None, self.origin) and busy.file == file
                if mine and (file is None or (start is not None and start >= busy.from_byte)):
                    self.hub.busy.remove(busy)
                    break
            else:
                return False
        extra = {"Retry_After": busy.retry_after} if busy.retry_after is not None else {}
        self.refuse(busy.status, None, "Too Many Requests" if busy.status == 429 else "Try again later", **extra)
        return True

    def refuse(self, status: int, code: str | None, message: str, **headers: str) -> None:
        extra = {"X_Error_Code": code} if code else {}
        body = json.dumps({"error": message}).encode()
        self.answer(status, body, Content_Type="application/json", X_Error_Message=message, **extra, **headers)

    def json(self, value: Any) -> None:
        self.answer(200, json.dumps(value).encode(), Content_Type="application/json")

    def route(self) -> None:
        parts = urlsplit(self.path)
        path = unquote(parts.path)
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if path != "/api/agent-harnesses" and self.try_later(None):
            return None
        if self.origin == "cdn":
            return self.cdn(path)
        if path == "/api/agent-harnesses":  # huggingface_hub's best-effort agent detection asks once
            return self.json({"standardEnvVars": [], "harnesses": {}})
        m = re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/(revision|tree|paths-info)/([^/]+)(/.*)?)?", path)
        if m:
            return self.api(m.group(1), m.group(2), m.group(3) or "main", (m.group(4) or "").strip("/"), query)
        m = re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path)
        if m:
            return self.resolve(m.group(1), m.group(2), m.group(3))
        self.refuse(404, None, "Sorry, we can't find the page you are looking for.")

    do_HEAD = do_GET = do_POST = route

    def access(self, repo_id: str, *, files: bool) -> Repo | None:
        """The repo if this request may see it (files: its contents too); a refusal sent otherwise."""
        auth = self.headers.get("Authorization", "")
        token = auth.removeprefix("Bearer ").strip() or None
        if token is not None and token not in self.hub.tokens:
            self.refuse(401, None, "Invalid credentials in Authorization header")
            return None
        repo = self.hub.repos.get(repo_id)
        if repo is None or (repo.private and token is None):
            self.refuse(404 if token else 401, "RepoNotFound", "Repository not found")
            return None
        if files and repo.gated and token is None:
            msg = f"Access to model {repo_id} is restricted. You must have access to it and be authenticated"
            self.refuse(401, "GatedRepo", msg + " to access it. Please log in.")
            return None
        return repo

    def at(self, repo_id: str, rev: str, *, files: bool) -> tuple[Repo, str] | None:
        """The repo and the commit ``rev`` names, if this request may see them; a refusal sent otherwise."""
        repo = self.access(repo_id, files=files)
        if repo is None:
            return None
        sha = repo.commit(rev)
        if sha is None:
            self.refuse(404, "RevisionNotFound", f"Invalid rev id: {rev}")
            return None
        return repo, sha

    def api(self, repo_id: str, kind: str | None, rev: str, sub: str, query: dict[str, str]) -> None:
        found = self.at(repo_id, rev, files=False)
        if found is None:
            return
        repo, sha = found
        files = repo.commits[sha]
        if kind in (None, "revision"):
            blobs = query.get("blobs", "").lower() == "true"
            siblings = [{"rfilename": p, **(blob_fields(b) if blobs else {})} for p, b in files.items()]
            listed = {"siblings": siblings} if self.hub.siblings else {}
            return self.json(
                {
                    **listed,
                    "_id": hashlib.md5(repo_id.encode()).hexdigest()[:24],
                    "id": repo_id,
                    "modelId": repo_id,
                    "sha": sha,
                    "private": repo.private,
                    "gated": "auto" if repo.gated else False,
                    "disabled": False,
                    "lastModified": "2025-01-01T00:00:00.000Z",
                    "tags": ["transformers", "safetensors"],
                    "library_name": "transformers",
                }
            )
        if kind == "tree":
            recursive = query.get("recursive", "").lower() == "true"
            return self.json(tree(files, sub, recursive))
        wanted = self._paths_asked()
        folders = {str(Path(p).parent) for p in files} - {"."}
        entries = [entry(p, files[p]) if p in files else folder_entry(p) for p in wanted if p in files or p in folders]
        self.json(entries)

    def _paths_asked(self) -> list[str]:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0) or 0)).decode()
        if self.headers.get("Content-Type", "").startswith("application/json"):
            return list(json.loads(body).get("paths", []))
        return [unquote(v) for v in parse_qs(body).get("paths", [])]

    def resolve(self, repo_id: str, rev: str, file: str) -> None:
        found = self.at(repo_id, rev, files=True)
        if found is None:
            return
        repo, sha = found
        blob = repo.commits[sha].get(file)
        if blob is None:
            return self.refuse(404, "EntryNotFound", f"{file} does not exist on {rev}", X_Repo_Commit=sha)
        if blob.lfs and self.hub.use_cdn:
            location = f"http://127.0.0.1:{self.hub.cdn_port}/cdn/{blob.sha256}"
            etag = f'"{blob.sha256}"'
            return self.answer(
                302, b"", file, Location=location, ETag=etag, X_Linked_Etag=etag, X_Linked_Size=str(blob.size),
                X_Repo_Commit=sha,
            )  # fmt: skip
        etag = f'"{blob.sha256 if blob.lfs else blob.git_sha1}"'
        self.send_file(
            blob, file, ETag=etag, X_Repo_Commit=sha, **({"X_Linked_Size": str(blob.size)} if blob.lfs else {})
        )

    def cdn(self, path: str) -> None:
        m = re.fullmatch(r"/cdn/([0-9a-f]{64})", path)
        blobs = [(p, b) for r in self.hub.repos.values() for c in r.commits.values() for p, b in c.items()]
        found = [(p, b) for p, b in blobs if m and b.sha256 == m.group(1)]
        if not found:
            return self.answer(404, b"NoSuchKey")
        file, blob = found[0]
        self.send_file(blob, file, ETag=f'"{blob.sha256}"')

    def send_file(self, blob: Blob, file: str, **headers: str) -> None:
        if self.try_later(file):
            return None
        asked = self.headers.get("Range")
        if asked is None or not self.hub.ranges:
            accept = {"Accept_Ranges": "bytes"} if self.hub.ranges else {}
            return self.answer(200, blob.path.read_bytes(), file, **accept, **headers)
        m = re.fullmatch(r"bytes=(\d*)-(\d*)", asked.strip())
        if m is None or m.group(1) == m.group(2) == "":
            return self.answer(416, b"", file, Content_Range=f"bytes */{blob.size}")
        if m.group(1) == "":
            start, end = max(0, blob.size - int(m.group(2))), blob.size
        else:
            start, end = int(m.group(1)), min(blob.size, int(m.group(2)) + 1 if m.group(2) else blob.size)
        if start >= blob.size or start >= end:
            return self.answer(416, b"", file, Content_Range=f"bytes */{blob.size}")
        if start >= self.hub.stalls.get(file, blob.size):
            with self.hub.lock:
                self.hub.requests.append(Request(self.origin, "GET", self.path, file, None, 0, 0))
            while file in self.hub.stalls:  # nothing sent, not even a status line
                if self.hub.stopped.wait(0.05) or self.client_gone():
                    self.close_connection = True
                    return
        with blob.path.open("rb") as f:
            f.seek(start)
            data = f.read(end - start)
        cut = self.hub.cuts.pop(file, None) if len(data) > self.hub.cuts.get(file, len(data)) else None
        if cut is not None:  # the connection drops after ``cut`` bytes of the body
            self.send_response(206)
            self.send_header("Content-Range", f"bytes {start}-{end - 1}/{blob.size}")
            self.send_header("Content-Length", str(len(data)))
            with self.hub.lock:
                self.hub.requests.append(Request(self.origin, "GET", self.path, file, (start, start + cut), cut, 206))
            self.end_headers()
            self.wfile.write(data[:cut])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        self.answer(206, data, file, Content_Range=f"bytes {start}-{end - 1}/{blob.size}", **headers)


def point_hub_at(monkeypatch: Any, tmp_path: Path, url: str) -> None:
    """Point this process's huggingface_hub at ``url``, with a cache under ``tmp_path``."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "ENDPOINT", url)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE", url + "/{repo_id}/resolve/{revision}/{filename}")
    monkeypatch.setattr(constants, "HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf" / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
