"""A stand-in for the Hugging Face Hub: the few routes huggingface_hub uses to list a model repository and to
download its files, served from memory on 127.0.0.1 (point HF_ENDPOINT at `url`).

    GET       /api/models/USER/REPO/tree/REVISION[/PATH]   the file listing (list_repo_files, list_repo_tree)
    GET       /api/models/USER/REPO[/revision/REVISION]    model info: commit and files (model_info, snapshots)
    HEAD, GET /USER/REPO/resolve/REVISION/PATH             a file, with the headers hf_hub_download checks:
              X-Repo-Commit, ETag (X-Linked-Etag for LFS-size files), Content-Length; Range for resumed downloads

Errors carry the X-Error-Code the real hub sends (RepoNotFound, RevisionNotFound, EntryNotFound), which
huggingface_hub turns into its typed exceptions.
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlparse

COMMIT = "0123456789abcdef0123456789abcdef01234567"  # every repository's one commit (a 40-hex sha, as the hub's)
REVISIONS = ("main", COMMIT)


class Hub:
    """repos: {"user/repo": {"path/in/repo": bytes}}. Records every request as "METHOD path" in `requests`."""

    def __init__(self, repos: dict[str, dict[str, bytes]]):
        self.repos = repos
        self.requests: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_HEAD(self):
                hub._answer(self, body=False)

            def do_GET(self):
                hub._answer(self, body=True)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "Hub":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

    # ------------------------------------------------------------------------------------------------ routes
    def _answer(self, h: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(h.path).path)
        self.requests.append(f"{h.command} {path}")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)/tree/([^/]+)(?:/(.*))?", path):
            return self._tree(h, m[1], m[2], m[3] or "")
        if m := re.fullmatch(r"/api/models/([^/]+/[^/]+)(?:/revision/([^/]+))?", path):
            return self._info(h, m[1], m[2] or "main")
        if m := re.fullmatch(r"/([^/]+/[^/]+)/resolve/([^/]+)/(.+)", path):
            return self._file(h, m[1], m[2], m[3], body)
        self._error(h, 404, None, "no such route")

    def _repo(self, h, repo: str, revision: str) -> dict[str, bytes] | None:
        if repo not in self.repos:
            self._error(h, 404, "RepoNotFound", f"Repository {repo} not found")
            return None
        if revision not in REVISIONS:
            self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {revision}")
            return None
        return self.repos[repo]

    def _tree(self, h, repo: str, revision: str, folder: str) -> None:
        files = self._repo(h, repo, revision)
        if files is None:
            return
        entries = [dict(type="file", oid=hashlib.sha1(data).hexdigest(), size=len(data), path=p)
                   for p, data in sorted(files.items()) if not folder or p.startswith(folder.rstrip("/") + "/")]
        self._json(h, entries)

    def _info(self, h, repo: str, revision: str) -> None:
        files = self._repo(h, repo, revision)
        if files is None:
            return
        self._json(h, dict(id=repo, modelId=repo, sha=COMMIT, private=False, gated=False, disabled=False,
                           tags=["gguf"], siblings=[dict(rfilename=p) for p in sorted(files)]))

    def _file(self, h, repo: str, revision: str, name: str, body: bool) -> None:
        files = self._repo(h, repo, revision)
        if files is None:
            return
        if name not in files:
            return self._error(h, 404, "EntryNotFound", f"{name} does not exist on {revision}")
        data = files[name]
        start = 0
        if m := re.fullmatch(r"bytes=(\d+)-", h.headers.get("Range") or ""):
            start = min(int(m[1]), len(data))
        h.send_response(206 if start else 200)
        h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
        h.send_header("Content-Type", "application/octet-stream")
        h.send_header("Content-Length", str(len(data) - start))
        if start:
            h.send_header("Content-Range", f"bytes {start}-{len(data) - 1}/{len(data)}")
        h.end_headers()
        if body:
            h.wfile.write(data[start:])

    @staticmethod
    def _json(h, value) -> None:
        raw = json.dumps(value).encode()
        h.send_response(200)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.send_header("X-Repo-Commit", COMMIT)
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)

    @staticmethod
    def _error(h, status: int, code: str | None, message: str) -> None:
        raw = json.dumps(dict(error=message)).encode()
        h.send_response(status)
        if code:
            h.send_header("X-Error-Code", code)
        h.send_header("X-Error-Message", message)
        if code == "EntryNotFound":
            h.send_header("X-Repo-Commit", COMMIT)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(raw)))
        h.end_headers()
        if h.command != "HEAD":
            h.wfile.write(raw)
