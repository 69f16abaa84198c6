"""Unit tests for plugins/modules/vllm_instance_wait.py.

The module's main() runs as in community.general's module tests (module args patched in, exit_json/fail_json
turned into exceptions). /health is asked of real HTTP servers on 127.0.0.1, so the module's HTTP code (open_url)
really runs; systemctl and journalctl are a fake systemd behind a patched run_command, and the module's clock and
sleep are a fake clock, so a 600 s wait takes no time.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from ansible.module_utils import basic
from ansible_collections.inferops.vllm.plugins.modules import vllm_instance_wait
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import (
    assert_documented_as_specified,
    assert_no_globals_besides_documentation,
    run_module,
)
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import exit_json as _exit_json
from ansible_collections.inferops.vllm.tests.unit.plugins.modules.utils import fail_json as _fail_json

SYSTEMCTL = "/usr/bin/systemctl"
JOURNALCTL = "/usr/bin/journalctl"
PROPERTIES = "LoadState,ActiveState,SubState,NRestarts,Result,ExecMainStatus,ActiveEnterTimestampMonotonic"
START = 5000.0  # the fake clock's time when a test starts

# The shape of a vLLM 0.32 start that dies loading the model (vLLM's log format, systemd's unit messages),
# with the access-log lines of the module's own /health polls in between.
CRASH_LOG = """\
INFO 05-09 07:40:58 [api_server.py:1876] vLLM API server version 0.32.0
INFO 05-09 07:40:58 [utils.py:253] non-default args: {'model': '/var/lib/vllm/models/smollm2', 'port': 8100}
INFO 05-09 07:41:02 [model.py:547] Resolved architecture: LlamaForCausalLM
INFO 05-09 07:41:05 [core.py:93] Initializing a V1 LLM engine (v0.32.0) with config: model='smollm2'
INFO:     127.0.0.1:40112 - "GET /health HTTP/1.1" 503 Service Unavailable

ERROR 05-09 07:41:12 [core.py:708] EngineCore failed to start.
ERROR 05-09 07:41:12 [core.py:708] Traceback (most recent call last):
ERROR 05-09 07:41:12 [core.py:708]   File "/opt/vllm/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", line 699
ERROR 05-09 07:41:12 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.
Process EngineCore_DP0:
INFO:     127.0.0.1:40118 - "GET /health HTTP/1.1" 503 Service Unavailable
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}
vllm@prefill-0.service: Main process exited, code=exited, status=1/FAILURE
vllm@prefill-0.service: Failed with result 'exit-code'.
"""
CRASH_ROOT_CAUSES = [
    "ERROR 05-09 07:41:12 [core.py:708] EngineCore failed to start.",
    "ERROR 05-09 07:41:12 [core.py:708] Traceback (most recent call last):",
    'ERROR 05-09 07:41:12 [core.py:708]   File "/opt/vllm/venv/lib/python3.11/site-packages/vllm/v1/engine/core.py", '
    "line 699",
    "ERROR 05-09 07:41:12 [core.py:708] torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB.",
    "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}",
    "vllm@prefill-0.service: Failed with result 'exit-code'.",
]
STARTED_LOG = """\
INFO 05-09 07:40:58 [api_server.py:1876] vLLM API server version 0.32.0
INFO:     Started server process [4711]
INFO:     Waiting for application startup.
INFO:     Application startup complete.
INFO:     127.0.0.1:40112 - "GET /health HTTP/1.1" 200 OK
INFO:     127.0.0.1:40113 - "GET /health HTTP/1.1" 200 OK
"""


def run(args=None, **kwargs):
    """vllm_instance_wait.main() with ``args``: what it exited (or, with expect="fail", failed) with."""
    return run_module(vllm_instance_wait.main, args, **kwargs)


def unit_state(active="active", sub="running", restarts=0, result="success", status=0, since=None, load="loaded"):
    """systemctl show's properties; ``since`` is the fake clock time at which the unit became active."""
    return {
        "LoadState": load,
        "ActiveState": active,
        "SubState": sub,
        "NRestarts": str(restarts),
        "Result": result,
        "ExecMainStatus": str(status),
        "ActiveEnterTimestampMonotonic": str(int(since * 1e6)) if since is not None else "0",
    }


class FakeSystemd:
    """Answers run_command like systemctl and journalctl; each unit has a list of states, one per
    ``systemctl show`` (the last one repeats), and a journal. A command it does not expect fails the test."""

    def __init__(self):
        self.units = {}
        self.calls = []

    def add(self, unit, *states, journal=""):
        self.units[unit] = {"states": list(states), "shows": 0, "journal": journal}

    def run_command(self, module, args, **kwargs):
        assert isinstance(args, list), "commands are run as argument lists, without a shell"
        self.calls.append(list(args))
        if args[0] == SYSTEMCTL:
            assert args[1:4] == ["show", "-p", PROPERTIES] and len(args) == 5, args
            unit = self.units[args[4]]
            state = unit["states"][min(unit["shows"], len(unit["states"]) - 1)]
            unit["shows"] += 1
            return 0, "".join(f"{key}={value}\n" for key, value in state.items()), ""
        if args[0] == JOURNALCTL:
            assert args[1] == "-u" and args[3] == "-n" and args[5:] == ["--no-pager", "-o", "cat"], args
            lines = self.units[args[2]]["journal"].splitlines()[-int(args[4]) :]
            return 0, "".join(f"{line}\n" for line in lines) if lines else "-- No entries --\n", ""
        raise AssertionError(f"unexpected command {args}")

    def commands(self, tool):
        return [call for call in self.calls if call[0] == tool]


class FakeClock:
    def __init__(self):
        self.now = START
        self.sleeps = []

    def clock(self):
        return self.now

    def sleep(self, seconds):
        assert seconds > 0
        self.sleeps.append(seconds)
        self.now += seconds


class FakeVllm:
    """A vLLM HTTP server on 127.0.0.1 that answers /health: 503 to the first ``health_failures`` requests, then 200."""

    def __init__(self, health_failures=0, status=200):
        self.health_failures = health_failures
        self.status = status
        self.requests = []
        app = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self):  # noqa: N802
                app.requests.append((self.path, dict(self.headers)))
                status = app.status
                if app.health_failures > 0:
                    app.health_failures -= 1
                    status = 503
                if self.path != "/health":
                    status = 404
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture()
def servers():
    started = []

    def start(**kwargs):
        server = FakeVllm(**kwargs)
        started.append(server)
        return server

    yield start
    for server in started:
        server.close()


@pytest.fixture()
def systemd():
    return FakeSystemd()


@pytest.fixture()
def clock():
    return FakeClock()


@pytest.fixture(autouse=True)
def module_harness(monkeypatch, systemd, clock):
    monkeypatch.setattr(basic.AnsibleModule, "exit_json", _exit_json)
    monkeypatch.setattr(basic.AnsibleModule, "fail_json", _fail_json)

    def run_command(module, args, **kwargs):
        # A plain function (not systemd's bound method), so that Python passes the module as `self`.
        return systemd.run_command(module, args, **kwargs)

    monkeypatch.setattr(basic.AnsibleModule, "run_command", run_command)
    monkeypatch.setattr(basic.AnsibleModule, "get_bin_path", lambda module, arg, *args, **kwargs: f"/usr/bin/{arg}")
    monkeypatch.setattr(vllm_instance_wait.VllmInstanceWait, "clock", staticmethod(clock.clock))
    monkeypatch.setattr(vllm_instance_wait.VllmInstanceWait, "sleep", staticmethod(clock.sleep))
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY", "no_proxy"):
        monkeypatch.delenv(var, raising=False)


def closed_port():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    return port


def health_requests(server):
    return [path for path, _headers in server.requests if path == "/health"]


# --------------------------------------------------------------------------- success


def test_healthy_immediately(servers, systemd, clock):
    first, second = servers(), servers()
    systemd.add("vllm@prefill-0.service", unit_state(since=START - 47.2), journal=STARTED_LOG)
    systemd.add("vllm@prefill-1.service", unit_state(since=START - 7300), journal="")
    result = run(
        {"instances": [{"name": "prefill-0", "port": first.port}, {"name": "prefill-1", "port": second.port}]}
    )

    assert result["changed"] is False
    assert result["msg"] == (
        f"prefill-0 already healthy on :{first.port} (unit active for 47 s); "
        f"prefill-1 already healthy on :{second.port} (unit active for 2 h 1 min)"
    )
    one = result["instances"][0]
    assert one["name"] == "prefill-0" and one["port"] == first.port and one["unit"] == "vllm@prefill-0.service"
    assert one["url"] == f"http://127.0.0.1:{first.port}/health"
    assert one["healthy"] is True and one["error"] is None
    assert one["seconds"] == 47.2 and one["waited"] == 0.0
    # The /health access-log lines are the module's own polls: the last line worth showing comes before them.
    assert one["last_log"] == "INFO:     Application startup complete."
    assert one["unit_state"]["ActiveState"] == "active" and one["unit_state"]["NRestarts"] == "0"
    assert result["instances"][1]["last_log"] is None  # "-- No entries --"
    assert result["elapsed"] == 0.0 and clock.sleeps == []
    assert len(health_requests(first)) == 1 and len(health_requests(second)) == 1
    assert systemd.commands(SYSTEMCTL) == [
        [SYSTEMCTL, "show", "-p", PROPERTIES, "vllm@prefill-0.service"],
        [SYSTEMCTL, "show", "-p", PROPERTIES, "vllm@prefill-1.service"],
    ]
    assert "journal" not in result and "root_causes" not in one
    top, per_instance = documented_keys()
    assert set(result) <= top and set(one) <= per_instance


def test_healthy_after_a_few_polls(servers, systemd, clock):
    server = servers(health_failures=3)  # still loading: 503 three times
    systemd.add("vllm@decode-0.service", unit_state(since=START - 5), journal=STARTED_LOG)
    result = run({"instances": [{"name": "decode-0", "port": server.port}]})

    assert clock.sleeps == [2.0, 2.0, 2.0]
    assert len(health_requests(server)) == 4
    inst = result["instances"][0]
    assert inst["healthy"] is True and inst["waited"] == 6.0
    assert inst["seconds"] == 11.0  # the unit became active 5 s before the wait began
    assert result["msg"] == f"decode-0 healthy on :{server.port} after 11 s"
    assert result["elapsed"] == 6.0
    assert len(systemd.commands(SYSTEMCTL)) == 4  # the unit is read on every poll


def test_seconds_fall_back_to_the_wait_without_active_timestamp(servers, systemd, clock):
    server = servers(health_failures=1)
    systemd.add("vllm@decode-0.service", unit_state(since=None))
    result = run({"instances": [{"name": "decode-0", "port": server.port}], "interval": 0.5})
    assert result["instances"][0]["seconds"] == 0.5
    assert result["msg"] == f"decode-0 healthy on :{server.port} after 0 s"  # rounded: 0.5 s


def test_custom_unit_host_and_proxy_not_used(servers, systemd, monkeypatch):
    server = servers()
    systemd.add("vllm-chat.service", unit_state(since=START - 3))
    # A proxy that would refuse every connection: the module must not go through it.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{closed_port()}")
    result = run(
        {"instances": [{"name": "chat", "port": server.port, "unit": "vllm-chat.service"}], "host": "127.0.0.1"}
    )
    assert result["instances"][0]["healthy"] is True
    assert systemd.commands(SYSTEMCTL)[0][-1] == "vllm-chat.service"
    assert systemd.commands(JOURNALCTL)[0][:3] == [JOURNALCTL, "-u", "vllm-chat.service"]


def test_restart_count_that_does_not_grow_is_fine(servers, systemd, clock):
    server = servers(health_failures=2)
    systemd.add("vllm@decode-0.service", unit_state(restarts=3, since=START - 1))  # restarts before this wait
    result = run({"instances": [{"name": "decode-0", "port": server.port}]})
    assert result["instances"][0]["healthy"] is True and len(clock.sleeps) == 2


# --------------------------------------------------------------------------- early failures


def test_unit_that_fails_stops_the_wait_with_its_journal(servers, systemd, clock):
    server = servers(status=503)
    systemd.add(
        "vllm@prefill-0.service",
        unit_state(since=START - 1),
        unit_state(active="failed", sub="failed", result="exit-code", status=1, since=START - 1),
        journal=CRASH_LOG,
    )
    result = run({"instances": [{"name": "prefill-0", "port": server.port}]}, expect="fail")

    assert clock.sleeps == [2.0]  # failed at the second poll, not after timeout=600
    assert len(health_requests(server)) == 1  # a failed unit is not asked again
    msg = result["msg"]
    url = f"http://127.0.0.1:{server.port}/health"
    assert msg.startswith(
        "vLLM instance prefill-0 is not healthy: its unit vllm@prefill-0.service failed "
        "(Result=exit-code, ExecMainStatus=1).\n"
    )
    assert f"  waited for: {url} to answer HTTP 200 (timeout=600s, every 2 s), for 2.0 s\n" in msg
    assert "  last check: HTTP 503\n" in msg
    assert (
        "  unit vllm@prefill-0.service: LoadState=loaded, ActiveState=failed, SubState=failed, NRestarts=0, "
        "Result=exit-code, ExecMainStatus=1, "
    ) in msg
    assert "root cause (the last 6 of the last 400 journal lines matching Error|Exception|Traceback" in msg
    for line in CRASH_ROOT_CAUSES:
        assert f"\n    {line}\n" in msg
    assert result["root_causes"] == CRASH_ROOT_CAUSES
    expected_journal = [line for line in CRASH_LOG.splitlines() if line and "GET /health" not in line]
    assert result["journal"] == expected_journal
    assert "last 12 journal lines (journalctl -u vllm@prefill-0.service -n 40 --no-pager -o cat):" in msg
    assert msg.endswith("\n    vllm@prefill-0.service: Failed with result 'exit-code'.")
    assert "GET /health" not in msg
    inst = result["instances"][0]
    assert inst["healthy"] is False and inst["seconds"] is None and inst["journal"] == expected_journal
    top, per_instance = documented_keys()
    assert set(result) == top and set(inst) == per_instance
    assert result["elapsed"] == 2.0
    assert systemd.commands(JOURNALCTL) == [
        [JOURNALCTL, "-u", "vllm@prefill-0.service", "-n", "400", "--no-pager", "-o", "cat"]
    ]


def test_unit_failed_although_its_port_answers(servers, systemd, clock):
    server = servers()  # something else (a stale process) answers on the port
    systemd.add("vllm@decode-0.service", unit_state(active="failed", sub="failed", result="exit-code", status=1))
    result = run({"instances": [{"name": "decode-0", "port": server.port}]}, expect="fail")
    assert "its unit vllm@decode-0.service failed" in result["msg"]
    assert "last check: none (the unit was not running)" in result["msg"]
    assert server.requests == [] and clock.sleeps == []


def test_restart_fails_early(servers, systemd, clock):
    server = servers(status=503)
    systemd.add(
        "vllm@decode-0.service",
        unit_state(restarts=2, since=START - 1),
        unit_state(restarts=2, since=START - 1),
        unit_state(restarts=3, since=START + 3.5, result="exit-code", status=1),
        journal="vllm@decode-0.service: Main process exited, code=killed, status=9/KILL\n"
        "vllm@decode-0.service: Failed with result 'oom-kill'.\n"
        "vllm@decode-0.service: Scheduled restart job, restart counter is at 3.\n",
    )
    result = run({"instances": [{"name": "decode-0", "port": server.port}]}, expect="fail")
    msg = result["msg"]
    assert msg.startswith(
        "vLLM instance decode-0 is not healthy: the vLLM process of vllm@decode-0.service died and systemd "
        "restarted it (NRestarts 2 -> 3; Result=exit-code, ExecMainStatus=1)."
    )
    assert "for 4.0 s" in msg and "NRestarts=3" in msg
    assert result["root_causes"] == [
        "vllm@decode-0.service: Main process exited, code=killed, status=9/KILL",
        "vllm@decode-0.service: Failed with result 'oom-kill'.",
    ]
    assert clock.sleeps == [2.0, 2.0]


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (
            unit_state(active="activating", sub="auto-restart", result="signal", status=9),
            "the vLLM process of vllm@p.service died and systemd is about to restart it "
            "(Result=signal, ExecMainStatus=9)",
        ),
        (
            unit_state(active="inactive", sub="dead", result="success", status=0),
            "its unit vllm@p.service is inactive: it was stopped, or vLLM exited (Result=success, ExecMainStatus=0)",
        ),
        (
            unit_state(active="inactive", sub="dead", load="not-found"),
            "its unit vllm@p.service does not exist (LoadState=not-found)",
        ),
    ],
)
def test_dead_unit_states(servers, systemd, clock, state, reason):
    server = servers(status=503)
    systemd.add("vllm@p.service", unit_state(since=START), state)
    result = run({"instances": [{"name": "p", "port": server.port}], "timeout": 600}, expect="fail")
    assert result["msg"].startswith(f"vLLM instance p is not healthy: {reason}.\n")
    assert result["instances"][0]["error"] == reason
    assert clock.sleeps == [2.0]


def test_several_failures_at_once_and_the_others_are_reported(servers, systemd):
    ok, loading = servers(), servers(status=503)
    failed = {"active": "failed", "sub": "failed", "result": "exit-code", "status": 1}
    systemd.add("vllm@a.service", unit_state(**failed), journal="ValueError: bad config a\n")
    systemd.add("vllm@b.service", unit_state(since=START))
    systemd.add("vllm@c.service", unit_state(since=START))
    systemd.add("vllm@d.service", unit_state(**failed), journal="ValueError: bad config d\n")
    args = {
        "instances": [
            {"name": "a", "port": closed_port()},
            {"name": "b", "port": ok.port},
            {"name": "c", "port": loading.port},
            {"name": "d", "port": closed_port()},
        ]
    }
    result = run(args, expect="fail")
    msg = result["msg"]
    assert msg.startswith("2 of 4 vLLM instances are not healthy.\n\nvLLM instance a is not healthy: its unit")
    assert "\n\nvLLM instance d is not healthy: its unit vllm@d.service failed" in msg
    assert msg.endswith("\n\nNot waited for further: c.")
    assert result["root_causes"] == ["ValueError: bad config a"]  # the first failed instance's
    a, b, c, d = result["instances"]
    assert d["root_causes"] == ["ValueError: bad config d"]
    assert b["healthy"] is True and b["error"] is None
    assert c["healthy"] is False and c["error"] == "not healthy yet when the wait stopped (last check: HTTP 503)"
    assert a["healthy"] is False and d["healthy"] is False


# --------------------------------------------------------------------------- timeout


def test_timeout_names_instance_url_and_state(systemd, clock):
    port = closed_port()
    systemd.add("vllm@decode-0.service", unit_state(since=START - 1), journal="INFO loading weights\n")
    result = run({"instances": [{"name": "decode-0", "port": port}], "timeout": 10}, expect="fail")
    msg = result["msg"]
    url = f"http://127.0.0.1:{port}/health"
    assert msg.startswith(f"vLLM instance decode-0 is not healthy: {url} did not answer HTTP 200 within timeout=10s.\n")
    assert "for 10.0 s" in msg and "Connection refused" in msg
    assert "unit vllm@decode-0.service: LoadState=loaded, ActiveState=active, SubState=running" in msg
    assert "root cause (the last 0 of the last 400 journal lines" in msg and "    (none)" in msg
    assert result["journal"] == ["INFO loading weights"]
    assert sum(clock.sleeps) == 10.0 and clock.sleeps == [2.0] * 5
    assert result["elapsed"] == 10.0


def test_timeout_while_health_answers_503(servers, systemd, clock):
    server = servers(status=503)
    systemd.add("vllm@decode-0.service", unit_state(since=START))
    result = run(
        {"instances": [{"name": "decode-0", "port": server.port}], "timeout": 3, "interval": 2}, expect="fail"
    )
    assert "last check: HTTP 503" in result["msg"]
    assert clock.sleeps == [2.0, 1.0]  # the last sleep ends at the deadline
    assert len(health_requests(server)) == 3


def test_timeout_zero_checks_once(systemd, clock):
    systemd.add("vllm@x.service", unit_state(since=START))
    result = run({"instances": [{"name": "x", "port": closed_port()}], "timeout": 0}, expect="fail")
    assert "within timeout=0s" in result["msg"] and clock.sleeps == []


def test_without_systemctl_and_journalctl(monkeypatch, servers, systemd):
    monkeypatch.setattr(basic.AnsibleModule, "get_bin_path", lambda module, arg, *args, **kwargs: None)
    server = servers()
    result = run({"instances": [{"name": "x", "port": server.port}]})
    assert result["instances"][0]["healthy"] is True and result["instances"][0]["unit_state"] is None
    assert result["msg"] == f"x already healthy on :{server.port}"

    result = run({"instances": [{"name": "y", "port": closed_port()}], "timeout": 2}, expect="fail")
    assert "unit vllm@y.service: unknown (systemctl not found)" in result["msg"]
    assert "journal: could not be read: journalctl not found" in result["msg"]
    assert systemd.calls == []


def test_journal_lines(systemd):
    journal = "".join(f"INFO line {n}\n" for n in range(600))
    systemd.add("vllm@x.service", unit_state(since=START), journal=journal)
    result = run(
        {"instances": [{"name": "x", "port": closed_port()}], "timeout": 0, "journal_lines": 5}, expect="fail"
    )
    assert result["journal"] == [f"INFO line {n}" for n in range(595, 600)]
    assert systemd.commands(JOURNALCTL)[-1][3:5] == ["-n", "400"]

    result = run(
        {"instances": [{"name": "x", "port": closed_port()}], "timeout": 0, "journal_lines": 500}, expect="fail"
    )
    assert len(result["journal"]) == 500
    assert systemd.commands(JOURNALCTL)[-1][3:5] == ["-n", "500"]

    result = run(
        {"instances": [{"name": "x", "port": closed_port()}], "timeout": 0, "journal_lines": 0}, expect="fail"
    )
    assert result["journal"] == [] and "last 0 journal lines" in result["msg"]


def test_root_causes_are_the_last_ten_of_the_last_400_lines(systemd):
    lines = [f"ERROR early {n}" for n in range(50)]  # beyond the last 400 lines: not shown
    lines += [f"INFO loading the room and zoom {n}" for n in range(400)]  # "oom" inside words is no OOM
    lines += [f"RuntimeError: late {n}" for n in range(12)]
    lines += ["Killed process 4711 (python3) total-vm:12345kB", "Out of memory: OOM-killer woke up", "INFO done"]
    systemd.add("vllm@x.service", unit_state(since=START), journal="\n".join(lines) + "\n")
    result = run({"instances": [{"name": "x", "port": closed_port()}], "timeout": 0}, expect="fail")
    assert result["root_causes"] == [f"RuntimeError: late {n}" for n in range(4, 12)] + [
        "Killed process 4711 (python3) total-vm:12345kB",
        "Out of memory: OOM-killer woke up",
    ]
    assert "ERROR early" not in result["msg"]


# --------------------------------------------------------------------------- secrets


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("Authorization: Bearer sk-SECRET-1", "Authorization: Bearer ********"),
        ("headers={'authorization': 'bearer sk-SECRET-2'}", "headers={'authorization': 'bearer ********'}"),
        ("api_key=sk-SECRET-3 model=x", "api_key=******** model=x"),
        ("api-key: sk-SECRET-4", "api-key: ********"),
        (
            "non-default args: {'api_key': 'sk-SECRET-5', 'port': 8100}",
            "non-default args: {'api_key': '********', 'port': 8100}",
        ),
        ("{'api_key': ['sk-SECRET-6', 'sk-SECRET-7'], 'x': 1}", "{'api_key': [********], 'x': 1}"),
        ('{"api_key": "sk-SECRET-8"}', '{"api_key": "********"}'),
        ("VLLM_API_KEY=sk-SECRET-9", "VLLM_API_KEY=********"),
        ("vllm serve m --api-key sk-SECRET-10 --port 1", "vllm serve m --api-key ******** --port 1"),
        ("X-Api-Key:sk-SECRET-11", "X-Api-Key:********"),
        (
            "INFO nothing secret here: api keys are in the EnvironmentFile",
            "INFO nothing secret here: api keys are in the EnvironmentFile",
        ),
    ],
)
def test_redact(line, expected):
    assert vllm_instance_wait.redact(line) == expected


def test_secrets_never_reach_the_result(servers, systemd):
    secrets = ["sk-SECRET-a1", "sk-SECRET-b2", "sk-SECRET-c3", "hf-SECRET-d4"]
    journal = (
        f"ERROR 05-09 07:41:12 [api_server.py:99] rejected request with Authorization: Bearer {secrets[0]}\n"
        f"INFO 05-09 07:41:12 [utils.py:253] non-default args: {{'api_key': ['{secrets[1]}'], 'port': 8100}}\n"
        f"\x1b[31mERROR\x1b[0m exception while reading api_key={secrets[2]}\n"
        f"INFO launching with --api-key {secrets[3]}\n"
    )
    systemd.add("vllm@x.service", unit_state(since=START), unit_state(active="failed", sub="failed"), journal=journal)
    result = run({"instances": [{"name": "x", "port": servers(status=503).port}]}, expect="fail")
    dumped = json.dumps(result)
    for secret in secrets:
        assert secret not in dumped
    assert result["journal"] == [
        "ERROR 05-09 07:41:12 [api_server.py:99] rejected request with Authorization: Bearer ********",
        "INFO 05-09 07:41:12 [utils.py:253] non-default args: {'api_key': [********], 'port': 8100}",
        "ERROR exception while reading api_key=********",  # terminal colours removed too
        "INFO launching with --api-key ********",
    ]
    assert result["root_causes"] == [result["journal"][0], result["journal"][2]]

    # The line shown on success is redacted the same way.
    healthy = servers()
    systemd.add("vllm@y.service", unit_state(since=START), journal=f"INFO ready, key api_key={secrets[0]}\n")
    result = run({"instances": [{"name": "y", "port": healthy.port}]})
    assert result["instances"][0]["last_log"] == "INFO ready, key api_key=********"


def test_long_lines_are_cut_after_redaction(systemd):
    systemd.add("vllm@x.service", unit_state(since=START), journal="x" * 495 + " Bearer sk-SECRET-LONG-TOKEN\n")
    result = run({"instances": [{"name": "x", "port": closed_port()}], "timeout": 0}, expect="fail")
    assert result["journal"] == ["x" * 495 + " Bear..."]
    assert "sk-SECRET" not in json.dumps(result)


# --------------------------------------------------------------------------- check mode and parameters


def test_check_mode_waits_for_nothing(servers, systemd, clock):
    server = servers()
    result = run(
        {"instances": [{"name": "prefill-0", "port": server.port}], "host": "::1", "_ansible_check_mode": True}
    )
    assert result["changed"] is False
    assert result["msg"] == "Check mode: waited for nothing, because the instances were not started in check mode."
    inst = result["instances"][0]
    assert inst["healthy"] is None and inst["seconds"] is None and inst["unit"] == "vllm@prefill-0.service"
    assert inst["url"] == f"http://[::1]:{server.port}/health"
    assert systemd.calls == [] and server.requests == [] and clock.sleeps == []


def test_no_instances():
    result = run({"instances": []})
    assert result["msg"] == "No instances to wait for." and result["instances"] == []


def test_invalid_parameters(systemd):
    result = run(
        {
            "instances": [{"name": "a", "port": 8100}, {"name": "a", "port": 70000}],
            "timeout": -1,
            "interval": 0,
            "journal_lines": -3,
        },
        expect="fail",
    )
    assert result["msg"] == (
        "Invalid parameters: instance name a is used more than once; instance a: port must be 1 to 65535, got 70000; "
        "timeout must be 0 or more, got -1; interval must be more than 0, got 0.0; journal_lines must be 0 or more, "
        "got -3"
    )
    assert systemd.calls == []


# --------------------------------------------------------------------------- documentation and structure


def test_documentation_matches_argument_spec():
    yaml = pytest.importorskip("yaml")
    doc = yaml.safe_load(vllm_instance_wait.DOCUMENTATION)
    spec = vllm_instance_wait.argument_spec()
    assert_documented_as_specified(doc["options"], spec)
    assert doc["attributes"]["check_mode"]["support"] == "full"
    assert doc["attributes"]["diff_mode"]["support"] == "none"

    for task in yaml.safe_load(vllm_instance_wait.EXAMPLES):
        args = task.get("inferops.vllm.vllm_instance_wait")
        if args is not None:
            assert set(args) <= set(spec), set(args) - set(spec)

    returned = yaml.safe_load(vllm_instance_wait.RETURN)
    assert set(returned) == {"msg", "elapsed", "instances", "journal", "root_causes"}
    assert set(returned["instances"]["contains"]) == {
        "name",
        "port",
        "unit",
        "url",
        "healthy",
        "seconds",
        "waited",
        "last_log",
        "unit_state",
        "error",
        "root_causes",
        "journal",
    }
    for key, entry in returned.items():
        assert "sample" in entry or "contains" in entry, key
        for sub, sub_entry in entry.get("contains", {}).items():
            assert "sample" in sub_entry, f"{key}.{sub}"


def documented_keys():
    yaml = pytest.importorskip("yaml")
    returned = yaml.safe_load(vllm_instance_wait.RETURN)
    return set(returned) | {"changed", "failed"}, set(returned["instances"]["contains"])


def test_module_has_no_globals_besides_documentation():
    assert_no_globals_besides_documentation(vllm_instance_wait)
