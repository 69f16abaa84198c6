"""A small package index for the tests: the simple repository API (PEP 503) over HTTP or HTTPS, with HTTP
basic authentication, serving wheels built here. It runs in the test process on 127.0.0.1 and records
every request, so that a test can say what pip and the role asked for, and with which credentials."""

from __future__ import annotations

import base64
import hashlib
import html
import re
import ssl
import subprocess
import threading
import zipfile
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def make_wheel(directory: Path, name: str, version: str, source: str = "", requires_python: str = "") -> Path:
    """A pure-Python wheel of one module (the distribution's name with underscores), installable by pip."""
    dist = re.sub(r"[-.]+", "_", name)
    path = directory / f"{dist}-{version}-py3-none-any.whl"
    info = f"{dist}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    if requires_python:
        metadata += f"Requires-Python: {requires_python}\n"
    files = {
        f"{dist}.py": source or f"VERSION = {version!r}\n",
        f"{info}/METADATA": metadata,
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: inferops-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    with zipfile.ZipFile(path, "w") as wheel:
        for member, text in files.items():
            data = text.encode()
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            wheel.writestr(member, data)
            record.append(f"{member},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        wheel.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def make_tls(directory: Path, address: str = "127.0.0.1") -> tuple[Path, Path, Path]:
    """(CA certificate, server certificate, server key) for the address, made with the openssl command."""
    def run(*argv: str) -> None:
        subprocess.run(argv, cwd=directory, check=True, capture_output=True)

    run("openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-days", "2",
        "-keyout", "ca.key", "-out", "ca.pem", "-subj", "/CN=inferops test index CA",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    run("openssl", "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", "server.key", "-out", "server.csr", "-subj", f"/CN={address}")
    (directory / "server.ext").write_text(f"subjectAltName=IP:{address}\nextendedKeyUsage=serverAuth\n")
    run("openssl", "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-days", "2", "-extfile", "server.ext", "-out", "server.pem")
    return directory / "ca.pem", directory / "server.pem", directory / "server.key"


class FakeIndex:
    """The index: `files` (wheel paths) served under /simple/<project>/ and /files/<name>. With `username` set,
    every request needs that user name and password (wrong: 403, none: 401, as pypiserver answers).
    `on_request` runs in the server thread for each request (to look at the host while pip runs)."""

    def __init__(self, files: list[Path], username: str = "", password: str = "",
                 tls: tuple[Path, Path] | None = None, on_request: Callable[[str], None] | None = None):
        self.files = {path.name: path for path in files}
        self.username, self.password = username, password
        self.requests: list[tuple[str, str]] = []  # (path, "ok" / "none" / "wrong")
        self.errors: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):  # noqa: N802 - http.server's name
                auth = index.check_auth(self.headers.get("Authorization"))
                index.requests.append((self.path, auth))
                if index.on_request is not None:
                    try:
                        index.on_request(self.path)
                    except Exception as exc:  # noqa: BLE001 - reported to the test, not to the client
                        index.errors.append(repr(exc))
                if auth == "none":
                    return self.answer(401, b"credentials needed", {"WWW-Authenticate": 'Basic realm="test"'})
                if auth == "wrong":
                    return self.answer(403, b"forbidden")
                m = re.fullmatch(r"/simple/([^/]+)/", self.path)
                if m:
                    project = normalise(m.group(1))
                    names = [n for n in sorted(index.files) if normalise(n.split("-")[0]) == project]
                    if not names:
                        return self.answer(404, b"not found")
                    links = "".join(
                        f'<a href="/files/{html.escape(n)}"{index.requires_python(n)}>{html.escape(n)}</a><br>\n'
                        for n in names)
                    return self.answer(200, f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(),
                                       {"Content-Type": "text/html"})
                m = re.fullmatch(r"/files/([^/]+)", self.path)
                if m and m.group(1) in index.files:
                    return self.answer(200, index.files[m.group(1)].read_bytes(),
                                       {"Content-Type": "application/octet-stream"})
                return self.answer(404, b"not found")

            def answer(self, status, body, headers=None):
                self.send_response(status)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.on_request = on_request
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.scheme = "http"
        if tls is not None:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(str(tls[0]), str(tls[1]))
            self.server.socket = context.wrap_socket(self.server.socket, server_side=True)
            self.scheme = "https"
        self.url = f"{self.scheme}://127.0.0.1:{self.server.server_address[1]}/simple"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def requires_python(self, name: str) -> str:
        """The anchor attribute data-requires-python of a wheel, from its METADATA, as PyPI writes it."""
        with zipfile.ZipFile(self.files[name]) as wheel:
            metadata = next(wheel.read(n).decode() for n in wheel.namelist() if n.endswith(".dist-info/METADATA"))
        m = re.search(r"^Requires-Python: (.+)$", metadata, re.M)
        return f' data-requires-python="{html.escape(m.group(1))}"' if m else ""

    def check_auth(self, header: str | None) -> str:
        if not self.username:
            return "ok"
        if not header or not header.startswith("Basic "):
            return "none"
        given = base64.b64decode(header[6:]).decode("utf-8", "replace")
        return "ok" if given == f"{self.username}:{self.password}" else "wrong"

    def __enter__(self) -> FakeIndex:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
