"""Steady client load from `vllm bench serve` (the real client, from the vLLM venv of a sandbox
container) for as long as an operation runs, and what it saw.

`vllm bench serve` sends a fixed number of prompts and only writes its result (--save-result) when
it has sent them all, so a load of unknown length is a chain of runs: each run sends `window`
seconds of requests at `rate` requests/s, and the next one starts `window - overlap` seconds after
it, before it ends (a run needs some seconds to start: importing vLLM, loading the tokenizer). The
runs' detailed results (--save-detailed) give every request's start time, TTFT and error; start
times are CLOCK_MONOTONIC seconds (time.perf_counter), which the containers share with this
process (one kernel), so requests can be placed against the operation's own timing.

Used by molecule/default/tests/test_day2.py and benchmarks/rolling_restart.py.
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import threading
import time
from dataclasses import dataclass, field

VLLM = "/opt/vllm/venv/bin/vllm"
RESULT_DIR = "/tmp/inferops-bench"
CA_IN_CONTAINER = "/tmp/inferops-bench-ca.pem"


def percentile(values: list[float], pct: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(pct / 100 * (len(ordered) - 1))))
    return ordered[rank]


@dataclass
class LoadResult:
    runs: int
    completed: int
    failed: int
    # (start time, ttft or None, error text or "") per request, sorted by start time.
    requests: list[tuple[float, float | None, str]] = field(default_factory=list)

    def errors(self) -> list[str]:
        return [err for _start, _ttft, err in self.requests if err]

    def between(self, start: float, end: float) -> list[tuple[float, float | None, str]]:
        return [r for r in self.requests if start <= r[0] <= end]

    def ttft_ms(self, start: float, end: float, pct: float) -> float | None:
        ttfts = [ttft * 1000 for s, ttft, err in self.between(start, end) if not err and ttft is not None]
        value = percentile(ttfts, pct)
        return round(value, 1) if value is not None else None

    def largest_gap(self, start: float, end: float) -> float:
        """Longest stretch of [start, end] in which no request was sent."""
        times = [start] + [s for s, _ttft, _err in self.between(start, end)] + [end]
        return max(b - a for a, b in zip(times, times[1:], strict=False))


class BenchLoad:
    """A chain of `vllm bench serve` runs in `container` against `base_url` (the front)."""

    def __init__(self, container: str, base_url: str, model: str, tokenizer: str, api_key: str,
                 ca_file: str | None = None, rate: float = 0.5, window: int = 120, overlap: int = 40,
                 input_len: int = 32, output_len: int = 8, max_concurrency: int = 4):
        self.container = container
        self.base_url = base_url
        self.model = model
        self.tokenizer = tokenizer
        self.api_key = api_key
        self.ca_file = ca_file
        self.rate = rate
        self.window = window
        self.overlap = overlap
        self.input_len = input_len
        self.output_len = output_len
        self.max_concurrency = max_concurrency
        self.tag = f"{os.getpid()}-{int(time.time())}"
        self.procs: list[subprocess.Popen] = []
        self.names: list[str] = []
        self.started_at: float | None = None
        self._stop = threading.Event()
        self.stopped = False
        self._thread: threading.Thread | None = None

    def _podman(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["podman", "exec", self.container, *args], capture_output=True, text=True,
                              check=False, **kwargs)

    def _start_run(self) -> None:
        name = f"run-{self.tag}-{len(self.names)}.json"
        prompts = max(1, round(self.rate * self.window))
        argv = [
            VLLM, "bench", "serve", "--backend", "openai", "--base-url", self.base_url,
            "--endpoint", "/v1/completions", "--model", self.model, "--tokenizer", self.tokenizer,
            "--dataset-name", "random", "--random-input-len", str(self.input_len),
            "--random-output-len", str(self.output_len), "--ignore-eos", "--temperature", "0",
            "--num-prompts", str(prompts), "--request-rate", str(self.rate), "--burstiness", "100",
            "--max-concurrency", str(self.max_concurrency), "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", RESULT_DIR, "--result-filename", name,
            "--percentile-metrics", "ttft", "--metric-percentiles", "50,99",
        ]
        env = ["-e", "OPENAI_API_KEY"]
        if self.ca_file:
            env += ["-e", f"SSL_CERT_FILE={CA_IN_CONTAINER}"]
        log = open(os.devnull, "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(["podman", "exec", *env, self.container, *argv], stdout=log,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, "OPENAI_API_KEY": self.api_key})
        self.procs.append(proc)
        self.names.append(name)

    def _chain(self) -> None:
        next_at = time.monotonic() + self.window - self.overlap
        while not self._stop.wait(max(0.0, next_at - time.monotonic())):
            self._start_run()
            next_at += self.window - self.overlap

    def start(self, settle: float = 30.0) -> float:
        """Start the load and return, `settle` seconds later (the first run sends by then: starting a run
        takes 10-20 s on 2 busy cores), the CLOCK_MONOTONIC time from which requests flow steadily: an
        operation measured against the load starts there."""
        self._podman("mkdir", "-p", RESULT_DIR)
        if self.ca_file:
            subprocess.run(["podman", "cp", self.ca_file, f"{self.container}:{CA_IN_CONTAINER}"], check=True)
        self.started_at = time.perf_counter()
        self._start_run()
        self._thread = threading.Thread(target=self._chain, daemon=True)
        self._thread.start()
        time.sleep(settle)
        return time.perf_counter()

    def stop(self, timeout: float = 900) -> LoadResult:
        """Start no further run, wait for the running ones and read every run's result."""
        self.stopped = True
        self._stop.set()
        if self._thread:
            self._thread.join()
        problems = []
        for proc, name in zip(self.procs, self.names, strict=True):
            try:
                _out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                _out, err = proc.communicate()
            if proc.returncode != 0:
                problems.append(f"{name}: vllm bench serve exited {proc.returncode}: {err[-1500:]}")
        requests: list[tuple[float, float | None, str]] = []
        completed = failed = 0
        for name in self.names:
            out = self._podman("cat", f"{RESULT_DIR}/{name}")
            if out.returncode != 0:
                problems.append(f"{name}: no result: {out.stderr.strip()}")
                continue
            data = json.loads(out.stdout)
            completed += int(data["completed"])
            failed += int(data["failed"])
            errors = data.get("errors") or [""] * len(data.get("start_times", []))
            ttfts = data.get("ttfts") or [None] * len(errors)
            for start, ttft, err in zip(data.get("start_times", []), ttfts, errors, strict=False):
                requests.append((float(start), float(ttft) if ttft else None, err or ""))
        self._podman("sh", "-c", f"rm -f {shlex.quote(RESULT_DIR)}/run-{self.tag}-*.json")
        if problems:
            raise RuntimeError("; ".join(problems))
        requests.sort()
        return LoadResult(runs=len(self.names), completed=completed, failed=failed, requests=requests)


def summary(result: LoadResult, start: float, end: float) -> str:
    inside = result.between(start, end)
    ttfts = [t * 1000 for _s, t, e in inside if not e and t is not None]
    median = f"{statistics.median(ttfts):.0f}" if ttfts else "n/a"
    return (f"{len(inside)} requests sent during the operation ({end - start:.0f} s), "
            f"{sum(1 for r in inside if r[2])} failed; whole load: {result.completed} completed, "
            f"{result.failed} failed in {result.runs} bench runs; TTFT p50 {median} ms")
