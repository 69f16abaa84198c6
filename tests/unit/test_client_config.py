"""playbooks/client_config.yml through the real ansible-playbook, on tests/preflight/good (hosts on unroutable
TEST-NET-1 addresses: contacting one would show as unreachable), and the helper it writes beside settings.json.

Every field of settings.json and openai.env is checked, for a plain HTTP front with the defaults and for an
HTTPS front with a private CA, a DNS name, a fixed client timeout and extra endpoints; bad inputs fail before
anything is written, naming the variable and the fix. The timeout is the preflight's own rule
(preflight.request_seconds), not a copy of it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from ansible_collections.inferops.vllm.plugins.plugin_utils import _preflight as pf
from test_preflight_inventories import ANSIBLE_PLAYBOOK, CASES_DIR, RECAP_RE, REPO, playbook_env

pytestmark = pytest.mark.skipif(ANSIBLE_PLAYBOOK is None, reason="ansible-playbook is not installed")

GOOD = CASES_DIR / "good"
CLIENT_KEY = "preflight-test-client-key-00001"
# A fallback endpoint in the router's front; its key must never reach settings.json or the output.
FRONT_FALLBACK = {"name": "openai", "url": "https://api.openai.com/v1",
                  "api_key": "sk-test-cloud-key-not-for-clients-01", "models": {"smollm2-135m-instruct": "gpt-4o-mini"}}


def _ca_pem() -> str:
    """A real self-signed CA certificate (ssl loads it), made with cryptography (an ansible-core dependency)."""
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "inferops test CA")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now)
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True).sign(key, hashes.SHA256()))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


CA_PEM = _ca_pem()


def _norouter(tmp: Path) -> Path:
    """tests/preflight/good without its router group."""
    case = tmp / "norouter"
    shutil.copytree(GOOD, case)
    (tmp / "models").symlink_to(CASES_DIR / "models", target_is_directory=True)
    hosts = (case / "hosts.yml").read_text(encoding="utf-8")
    (case / "hosts.yml").write_text(hosts[:hosts.index("router:")], encoding="utf-8")
    return case


def cases(tmp: Path) -> dict[str, tuple[Path, dict, str | None]]:
    """name -> (inventory, extra vars, None for success or a pattern the failure must show)."""
    ca = tmp / "ca.pem"
    ca.write_text(CA_PEM)
    tls = {"vllm_router_tls_certificate": str(ca), "vllm_router_tls_key": str(ca)}
    return {
        "plain": (GOOD, {}, None),
        "tls": (GOOD, {**tls, "inferops_front_ca_file": str(ca), "inferops_front_host": "llm.example.com",
                       "inferops_client_timeout_seconds": 600, "vllm_client_config_api_key_env": "TAOTOKEN_API_KEY",
                       "vllm_client_config_max_retries": 5, "vllm_client_config_retry_backoff": 2,
                       "vllm_client_config_endpoints": {"cloud_fallback": "https://api.example.com/v1"},
                       "vllm_client_config_routing": {"strategy": "local_first", "fallback_on_error": True}}, None),
        "rate": (GOOD, {"inferops_min_tokens_per_second": 7}, None),
        "no_router": (_norouter(tmp), {}, r"\[front\] router: the inventory has no router host.*Fix: put the host"),
        "loopback": (GOOD, {"vllm_router_front_bind": "127.0.0.1"},
                     r"\[front\] router-1: vllm_router_front_bind: is '127.0.0.1', so the front listens on the router "
                     r"host's loopback only.*vllm_client_config_front_host"),
        "short_timeout": (GOOD, {"inferops_client_timeout_seconds": 10},
                          r"\[client\] inferops_client_timeout_seconds: is 10 s, but one request of max_model_len 512 "
                          r"tokens \(prefill-1\) at inferops_min_tokens_per_second 20 tokens/s takes 26 s"),
        "key_as_name": (GOOD, {"vllm_router_api_keys": ["ABCDEFGHIJKLMNOPQRSTUVWXYZ"],
                               "vllm_client_config_api_key_env": "ABCDEFGHIJKLMNOPQRSTUVWXYZ"},
                        r"vllm_client_config_api_key_env must be the NAME of the environment variable"),
        "ca_without_tls": (GOOD, {"inferops_front_ca_file": str(ca)},
                           r"is only used when the front serves HTTPS .* it serves http\b"),
        "fallback_nowhere": (GOOD, {"vllm_client_config_routing": {"strategy": "x", "fallback_on_error": True}},
                             r"fallback_on_error needs another endpoint"),
        "front_fallback": (GOOD, {"vllm_router_front_fallbacks": [FRONT_FALLBACK]}, None),
        "front_fallback_elsewhere": (
            GOOD, {"vllm_router_front_fallbacks": [FRONT_FALLBACK],
                   "vllm_client_config_endpoints": {"cloud_fallback": "https://api.example.com/v1"}},
            r"the front on router-1 falls back to its cloud endpoints itself \(vllm_router_front_fallbacks\), so "
            r"clients keep one key and the front as their only endpoint; but vllm_client_config_endpoints names "
            r"cloud_fallback, which is not the front\. Fix: remove the other endpoints"),
    }


def _run(inventory: Path, extra: dict, out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [ANSIBLE_PLAYBOOK, "-i", str(inventory), str(REPO / "playbooks" / "client_config.yml"),
         "-e", json.dumps({"vllm_client_config_dir": str(out), **extra})],
        cwd=REPO, env=playbook_env(), capture_output=True, text=True, timeout=180, check=False)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("client-config")
    table = cases(tmp)
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, inv, extra, tmp / "out" / name)
                   for name, (inv, extra, _expected) in table.items()}
        results = {name: (future.result(), tmp / "out" / name, table[name][2]) for name, future in futures.items()}
    # A second run of the plain case changes nothing.
    results["plain_again"] = (_run(GOOD, {}, tmp / "out" / "plain"), tmp / "out" / "plain", None)
    return results


def _output(run) -> str:
    return run.stdout + run.stderr


def _recap(output: str) -> dict[str, tuple[int, ...]]:
    return {m[1]: tuple(int(x) for x in m.groups()[1:]) for m in RECAP_RE.finditer(output)}


def _untouched(output: str) -> None:
    """No inventory host was contacted or changed (the controller wrote the files)."""
    for host, (_ok, changed, unreachable, _failed) in _recap(output).items():
        if host != "localhost":
            assert changed == 0 and unreachable == 0, f"{host}: changed={changed} unreachable={unreachable}\n{output}"
    assert "Gathering Facts" not in output


def test_plain_front_with_the_defaults(runs):
    run, out, _expected = runs["plain"]
    assert run.returncode == 0, _output(run)
    _untouched(_output(run))
    settings = json.loads((out / "settings.json").read_text())
    # The sources' shape, in their order.
    assert list(settings) == ["provider", "base_url", "api_key_env", "default_model", "timeout_seconds", "max_retries",
                              "retry_backoff", "endpoints", "routing"]
    assert settings == {
        "provider": "inferops-vllm", "base_url": "http://192.0.2.5:8000", "api_key_env": "INFEROPS_API_KEY",
        "default_model": "smollm2-135m-instruct", "timeout_seconds": pf.request_seconds(512, 20), "max_retries": 3,
        "retry_backoff": 1.5, "endpoints": {"local_vllm": "http://192.0.2.5:8000/v1"},
        "routing": {"strategy": "local_first", "fallback_on_error": False}}
    assert settings["timeout_seconds"] == 26
    env = (out / "openai.env").read_text()
    assert "export OPENAI_BASE_URL=http://192.0.2.5:8000/v1\n" in env
    assert 'export OPENAI_API_KEY="${INFEROPS_API_KEY:?export INFEROPS_API_KEY=' in env
    assert "export INFEROPS_MODEL=smollm2-135m-instruct\n" in env and "export INFEROPS_TIMEOUT_SECONDS=26\n" in env
    assert "SSL_CERT_FILE" not in env and not (out / "ca.pem").exists()
    for name, mode in (("settings.json", 0o644), ("openai.env", 0o644), ("client_from_settings.py", 0o644)):
        assert (out / name).stat().st_mode & 0o777 == mode, name
    assert (out / "client_from_settings.py").read_bytes() == (
        REPO / "roles" / "vllm_client_config" / "files" / "client_from_settings.py").read_bytes()
    # Nothing secret anywhere.
    for path in out.iterdir():
        assert CLIENT_KEY not in path.read_text() and "preflight-test-instance-key" not in path.read_text()


def test_a_second_run_changes_nothing(runs):
    run, _out, _expected = runs["plain_again"]
    assert run.returncode == 0, _output(run)
    assert _recap(_output(run))["localhost"][1] == 0, _output(run)


def test_https_front_with_a_private_ca_and_a_fixed_timeout(runs):
    run, out, _expected = runs["tls"]
    assert run.returncode == 0, _output(run)
    _untouched(_output(run))
    settings = json.loads((out / "settings.json").read_text())
    assert settings == {
        "provider": "inferops-vllm", "base_url": "https://llm.example.com:8000", "api_key_env": "TAOTOKEN_API_KEY",
        "default_model": "smollm2-135m-instruct", "timeout_seconds": 600, "max_retries": 5, "retry_backoff": 2.0,
        "endpoints": {"local_vllm": "https://llm.example.com:8000/v1", "cloud_fallback": "https://api.example.com/v1"},
        "routing": {"strategy": "local_first", "fallback_on_error": True}, "ca_file": "ca.pem"}
    assert (out / "ca.pem").read_text() == CA_PEM
    env = (out / "openai.env").read_text()
    assert "export OPENAI_BASE_URL=https://llm.example.com:8000/v1\n" in env
    assert f"export SSL_CERT_FILE={out}/ca.pem\n" in env
    assert 'OPENAI_API_KEY="${TAOTOKEN_API_KEY:?' in env


def test_the_timeout_follows_the_minimum_rate(runs):
    run, out, _expected = runs["rate"]
    assert run.returncode == 0, _output(run)
    assert json.loads((out / "settings.json").read_text())["timeout_seconds"] == pf.request_seconds(512, 7) == 74


def test_a_front_with_fallbacks_is_local_first_with_fallback_on_error_and_the_front_only(runs):
    run, out, _expected = runs["front_fallback"]
    assert run.returncode == 0, _output(run)
    _untouched(_output(run))
    settings = json.loads((out / "settings.json").read_text())
    assert settings["routing"] == {"strategy": "local_first", "fallback_on_error": True}
    assert settings["endpoints"] == {"local_vllm": "http://192.0.2.5:8000/v1", "cloud_fallback": "http://192.0.2.5:8000/v1"}
    assert settings["base_url"] == "http://192.0.2.5:8000"
    written = "".join(p.read_text() for p in out.iterdir() if p.is_file())
    assert FRONT_FALLBACK["api_key"] not in written + _output(run) and "api.openai.com" not in written


@pytest.mark.parametrize("case", ["no_router", "loopback", "short_timeout", "key_as_name", "ca_without_tls",
                                  "fallback_nowhere", "front_fallback_elsewhere"])
def test_bad_input_is_refused_before_anything_is_written(runs, case):
    run, out, pattern = runs[case]
    output = " ".join(_output(run).split())
    assert run.returncode != 0, output
    assert re.search(pattern, output), f"{pattern!r} not in:\n{output}"
    assert not out.exists()
    _untouched(_output(run))
    if case == "key_as_name":
        assert "ABCDEFGHIJKLMNOPQRSTUVWXYZ" not in output and "it is one of vllm_router_api_keys (not shown)" in output


# --- the helper, as the molecule test uses it -------------------------------------------------------


def _helper(out: Path):
    sys.path.insert(0, str(out))
    try:
        import client_from_settings as helper
    finally:
        sys.path.remove(str(out))
    return helper


def test_the_helper_builds_the_client_from_settings_json_alone(runs):
    openai = pytest.importorskip("openai")
    _run_tls, out, _expected = runs["tls"]
    helper = _helper(out)
    settings_path = out / "settings.json"
    client = helper.client_from_settings(settings_path, environ={"TAOTOKEN_API_KEY": "sk-test-0123456789abcdef"})
    assert isinstance(client, openai.OpenAI)
    assert str(client.base_url).rstrip("/") == "https://llm.example.com:8000/v1"
    assert (client.api_key, client.timeout, client.max_retries) == ("sk-test-0123456789abcdef", 600.0, 5)
    assert helper.ca_path(helper.load_settings(settings_path), settings_path) == str(out / "ca.pem")
    with pytest.raises(helper.SettingsError, match="TAOTOKEN_API_KEY .* is not set: export TAOTOKEN_API_KEY="):
        helper.client_from_settings(settings_path, environ={})
    # Overrides go to openai.OpenAI last.
    assert helper.client_from_settings(settings_path, environ={"TAOTOKEN_API_KEY": "k"}, max_retries=0).max_retries == 0


def test_the_helper_without_ca_and_its_refusals(runs, tmp_path):
    pytest.importorskip("openai")
    _run_plain, out, _expected = runs["plain"]
    helper = _helper(out)
    settings = helper.load_settings(out / "settings.json")
    assert helper.api_base(settings) == "http://192.0.2.5:8000/v1"
    assert helper.api_base({"base_url": "http://h:8000/"}) == "http://h:8000/v1"
    assert helper.ca_path(settings, out / "settings.json") is None
    broken = tmp_path / "settings.json"
    broken.write_text(json.dumps({"base_url": "http://h:8000"}))
    with pytest.raises(helper.SettingsError, match="lacks api_key_env, default_model, timeout_seconds, max_retries"):
        helper.load_settings(broken)
    broken.write_text(json.dumps({**settings, "ca_file": "missing.pem"}))
    with pytest.raises(helper.SettingsError, match="names ca_file 'missing.pem'"):
        helper.client_from_settings(broken, environ={"INFEROPS_API_KEY": "k"})
    # As a command: without the key's variable it says what to export.
    run = subprocess.run([sys.executable, str(out / "client_from_settings.py"), str(out / "settings.json")],
                         capture_output=True, text=True, timeout=60, check=False, env={"PATH": "/usr/bin:/bin"})
    assert run.returncode == 1 and "export INFEROPS_API_KEY=" in run.stderr
