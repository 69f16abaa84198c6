# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""benchmarks/chaos.py's /health probe (issue #24 point 3): the script it runs on the router host measures a late
answer instead of cutting it, and the summary per operation counts the probes over the routers' timeout."""

from __future__ import annotations

import http.server
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import chaos  # noqa: E402  (benchmarks/ is no package)

DELAYS = {"/fast/health": 0.0, "/slow/health": 1.2, "/down/health": None}


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802  (http.server's name)
        delay = DELAYS[self.path]
        if delay is None:
            self.send_response(503)
            self.end_headers()
            return
        time.sleep(delay)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *args):  # quiet
        pass


@pytest.fixture
def server():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_the_probe_script_measures_late_answers_and_error_statuses(server):
    urls = [f"{server}{path}" for path in DELAYS]
    started = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-u", "-c", chaos.PROBE_SCRIPT, "0.3", *urls],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    time.sleep(3)
    out, _err = proc.communicate("", timeout=30)  # the end of its input stops it
    assert proc.returncode == 0
    seen: dict[str, list[tuple[float, float, int]]] = {}
    for line in out.splitlines():
        start, url, ms, status = line.split()
        seen.setdefault(url, []).append((float(start), float(ms), int(status)))
    assert set(seen) == set(urls)
    fast, slow, down = (seen[url] for url in urls)
    # The same clock as this process's (the benchmark compares it with its perf_counter windows).
    assert all(started - 1 <= start <= time.monotonic() for start, _ms, _status in fast + slow + down)
    assert {status for *_rest, status in fast} == {200} and {status for *_rest, status in down} == {503}
    assert all(ms >= 1200 for _start, ms, _status in slow), slow  # measured, not cut
    assert max(ms for _start, ms, _status in fast) < 1000
    assert len(fast) > len(slow) >= 2


def test_the_summary_is_per_instance_within_the_window_and_counts_probes_over_the_timeout():
    probe = chaos.HealthProbe.__new__(chaos.HealthProbe)  # no podman: the samples are given
    probe.names = {"u0": "prefill-0", "u1": "decode-0"}
    probe.samples = [(10.0, "prefill-0", 100.0, 200), (11.0, "prefill-0", 6000.0, 200),
                     (12.0, "prefill-0", 300.0, 200), (30.0, "prefill-0", 9000.0, 200),
                     (11.5, "decode-0", 50.0, 200)]
    summary = probe.summary(10.0, 20.0, timeout_s=5)
    assert summary["prefill-0"][0] == 3 and summary["prefill-0"][3] == 6000 and summary["prefill-0"][4] == 1
    assert summary["decode-0"] == (1, 50, 50, 50, 0)
    assert probe.summary(40.0, 50.0, timeout_s=5) == {}
