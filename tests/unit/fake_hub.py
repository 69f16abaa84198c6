"""A stand-in for the Hugging Face hub in the tests, without the network.

- FakeHub: the API route inferops_hf_fetch.py asks before downloading,
  GET /api/models/<model>/revision/<revision>, on 127.0.0.1, answering as the hub does (200 with the commit,
  401 without or with a wrong token for a gated model, 403, 404), and counting the requests; also the file
  list of huggingface_hub's snapshot_download (/api/models/<model>/tree/<revision>), empty, so that the real
  library completes against it.
- stub_huggingface_hub(): a `huggingface_hub` package for PYTHONPATH whose snapshot_download writes a
  config.json into local_dir and records how it was called (token passed as an argument, endpoint), in place
  of the real library, which the tools venv does not have.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

COMMIT = "0123456789abcdef0123456789abcdef01234567"

STUB = '''
import json, os, pathlib


def snapshot_download(repo_id, revision=None, local_dir=None, token=None, endpoint=None, **kwargs):
    record = {"repo_id": repo_id, "revision": revision, "local_dir": local_dir, "token": token,
              "endpoint": endpoint, "environ_token": os.environ.get("HF_TOKEN")}
    with open(os.environ["INFEROPS_STUB_LOG"], "a") as handle:
        handle.write(json.dumps(record) + "\\n")
    if os.environ.get("INFEROPS_STUB_FAIL"):
        raise RuntimeError("simulated download failure with token " + str(token))
    target = pathlib.Path(local_dir)
    target.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return str(target)
'''


def stub_huggingface_hub(directory: Path) -> Path:
    """A directory for PYTHONPATH holding the stub package."""
    package = directory / "huggingface_hub"
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text(STUB)
    return directory


class FakeHub:
    """models: model id -> commit; `token`: the token a gated model needs (empty: public models)."""

    def __init__(self, models: dict[str, str], token: str = "", gated_403: bool = False):
        self.models, self.token, self.gated_403 = models, token, gated_403
        self.requests: list[tuple[str, str]] = []  # (path, Authorization header)
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):  # noqa: N802 - http.server's name
                auth = self.headers.get("Authorization", "")
                hub.requests.append((self.path, auth))
                tree = re.fullmatch(r"/api/models/(.+)/tree/([^/?]+)(\?.*)?", self.path)
                if tree and tree.group(1) in hub.models:  # the real library lists the files (none here)
                    return self.answer(200, [])
                m = re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", self.path)
                if not m:
                    return self.answer(404, {"error": "not found"})
                model, revision = m.groups()
                if hub.token and auth != f"Bearer {hub.token}":
                    return self.answer(401, {"error": "Invalid credentials in Authorization header"})
                if hub.gated_403:
                    return self.answer(403, {"error": "Access to model is restricted"})
                if model not in hub.models or revision not in (hub.models[model], "main"):
                    return self.answer(404, {"error": "Revision Not Found"})
                return self.answer(200, {"id": model, "sha": hub.models[model], "siblings": []})

            def answer(self, status, body):
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> FakeHub:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
