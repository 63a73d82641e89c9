"""A stand-in for the Hugging Face Hub, which this machine cannot reach: an HTTP server on
localhost that serves local folders as hub repositories at one commit, for huggingface_hub's own
client (`HF_ENDPOINT`): the repository's info and file tree, and each file (HEAD for its
metadata, GET for its bytes, counted). The client then writes its cache as it would from the Hub
(models--org--name/blobs, snapshots/<commit>/, refs/main). Test-only."""

from __future__ import annotations

import hashlib
import json
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlparse


class FakeHub:
    def __init__(self, repos: dict[str, Path]) -> None:
        self.repos = repos
        self.commits = {repo: hashlib.sha1(repo.encode()).hexdigest() for repo in repos}
        self.downloads: Counter[str] = Counter()  # "repo/file" -> GETs of its bytes
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                hub._answer(self, body=True)

            def do_HEAD(self) -> None:
                hub._answer(self, body=False)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join()

    def _files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def _answer(self, handler: BaseHTTPRequestHandler, body: bool) -> None:
        path = unquote(urlparse(handler.path).path).strip("/")
        parts = path.split("/")
        if parts[:2] == ["api", "models"]:
            rest = "/".join(parts[2:])
            for repo in self.repos:
                if rest.startswith(repo + "/revision/"):
                    files = self._files(repo)
                    siblings = [{"rfilename": name} for name in files]
                    return self._json(handler, {"id": repo, "sha": self.commits[repo], "siblings": siblings}, body)
                if rest.startswith(repo + "/tree/"):
                    tree = [
                        {
                            "type": "file",
                            "path": name,
                            "size": p.stat().st_size,
                            "oid": hashlib.sha1(p.read_bytes()).hexdigest(),
                            "lfs": {
                                "oid": hashlib.sha256(p.read_bytes()).hexdigest(),
                                "size": p.stat().st_size,
                                "pointerSize": 134,
                            },
                        }
                        for name, p in self._files(repo).items()
                    ]
                    return self._json(handler, tree, body)
        for repo in self.repos:
            prefix = repo + "/resolve/"
            if path.startswith(prefix):
                _, _, name = path[len(prefix) :].partition("/")
                file = self._files(repo).get(name)
                if file is None:
                    break
                data = file.read_bytes()
                handler.send_response(200)
                handler.send_header("X-Repo-Commit", self.commits[repo])
                handler.send_header("ETag", f'"{hashlib.sha256(data).hexdigest()}"')
                handler.send_header("Content-Length", str(len(data)))
                handler.end_headers()
                if body:
                    self.downloads[f"{repo}/{name}"] += 1
                    handler.wfile.write(data)
                return None
        handler.send_response(404)
        handler.send_header("X-Error-Code", "RepoNotFound")
        handler.send_header("Content-Length", "0")
        handler.end_headers()
        return None

    @staticmethod
    def _json(handler: BaseHTTPRequestHandler, value: object, body: bool) -> None:
        data = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        if body:
            handler.wfile.write(data)
