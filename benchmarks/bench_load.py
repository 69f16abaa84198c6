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


# A prompt of about 32 tokens of the small model's tokenizer (plain words; the exact count does not matter
# for the day-2 checks, only that it is several tokens so that KV really moves from prefill to decode).
_WORDS = ("the river city lights morning quiet garden paper window travel music friendly mountain coffee "
          "yellow summer careful history number forest letter market ocean simple").split()


class FrontLoad:
    """Steady streaming completions from this process (no vLLM import, no container) through `base_url`.

    Sends one request every 1/`rate` s (at most `max_concurrency` in flight: a request due while that many
    are running waits, as `vllm bench serve --max-concurrency` does) and records each request's start
    (CLOCK_MONOTONIC, time.perf_counter, as the containers share this kernel's clock), its time to the
    first streamed token and its error. `stop()` stops sending at once and waits only for what is in flight.
    The same LoadResult as BenchLoad, so the same judgements apply. With `local_only`, an answer that the front
    says a fallback served (X-Inferops-Served-By) counts as failed: a fallback hides a failure of the local pool,
    which is what an operation under this load must not have."""

    def __init__(self, base_url: str, model: str, api_key: str, ca_file: str | None = None, rate: float = 0.5,
                 output_len: int = 8, max_concurrency: int = 4, timeout: float = 300, local_only: bool = True):
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.api_key = api_key
        self.ca_file = ca_file
        self.rate = rate
        self.output_len = output_len
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.local_only = local_only
        self.started_at: float | None = None
        self.stopped = False
        self._stop = threading.Event()
        self._slots = threading.BoundedSemaphore(max_concurrency)
        self._lock = threading.Lock()
        self._records: list[tuple[float, float | None, str]] = []
        self._workers: list[threading.Thread] = []
        self._thread: threading.Thread | None = None

    def _context(self):
        import ssl  # noqa: PLC0415 - only for https fronts
        return ssl.create_default_context(cafile=self.ca_file) if self.ca_file else None

    def _one(self, number: int) -> None:
        import urllib.error  # noqa: PLC0415
        import urllib.request  # noqa: PLC0415
        words = [_WORDS[(number * 7 + i) % len(_WORDS)] for i in range(28)]
        body = {"model": self.model, "prompt": " ".join(words), "max_tokens": self.output_len, "temperature": 0,
                "ignore_eos": True, "stream": True}
        req = urllib.request.Request(f"{self.base_url}/v1/completions", data=json.dumps(body).encode(),
                                     method="POST", headers={"Content-Type": "application/json",
                                                             "Authorization": f"Bearer {self.api_key}"})
        start = time.perf_counter()
        ttft, error = None, ""
        try:
            context = self._context() if self.base_url.startswith("https") else None
            with urllib.request.urlopen(req, timeout=self.timeout, context=context) as resp:
                served_by = resp.headers.get("X-Inferops-Served-By")
                if self.local_only and served_by not in (None, "local"):
                    error = f"served by {served_by}, not by the local pool"
                done = False
                for raw in resp:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    if line == b"data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[5:])
                    if "error" in chunk and not error:
                        error = f"error chunk: {json.dumps(chunk)[:300]}"
                        break
                    if ttft is None:
                        ttft = time.perf_counter() - start
                if not done and not error:
                    error = "stream ended without [DONE]"
        except urllib.error.HTTPError as exc:
            error = f"HTTP {exc.code}: {exc.read()[:300].decode(errors='replace')}"
        except (OSError, ValueError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        finally:
            self._slots.release()
        with self._lock:
            self._records.append((start, ttft, error))

    def _send(self) -> None:
        number = 0
        next_at = time.monotonic()
        while not self._stop.is_set():
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                break
            while not self._slots.acquire(timeout=0.5):
                if self._stop.is_set():
                    return
            worker = threading.Thread(target=self._one, args=(number,), daemon=True)
            worker.start()
            self._workers.append(worker)
            number += 1
            next_at = max(next_at + 1 / self.rate, time.monotonic() - 1 / self.rate)

    def start(self, settle: float = 0.0) -> float:
        """Start sending; returns the CLOCK_MONOTONIC time from which requests flow."""
        self.started_at = time.perf_counter()
        self._thread = threading.Thread(target=self._send, daemon=True)
        self._thread.start()
        if settle:
            time.sleep(settle)
        return time.perf_counter()

    def snapshot(self) -> LoadResult:
        """What finished so far (the load goes on)."""
        with self._lock:
            requests = sorted(self._records)
        failed = sum(1 for r in requests if r[2])
        return LoadResult(runs=1, completed=len(requests) - failed, failed=failed, requests=requests)

    def stop(self, timeout: float | None = None) -> LoadResult:
        """Send nothing more, wait for the requests in flight (each bounded by its own timeout)."""
        self.stopped = True
        self._stop.set()
        if self._thread:
            self._thread.join()
        deadline = time.monotonic() + (timeout if timeout is not None else self.timeout + 5)
        for worker in self._workers:
            worker.join(max(0.0, deadline - time.monotonic()))
        unfinished = sum(1 for w in self._workers if w.is_alive())
        result = self.snapshot()
        if unfinished:
            raise RuntimeError(f"{unfinished} requests still in flight after the stop's timeout")
        return result
