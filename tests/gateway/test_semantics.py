"""Semantic tests of the front's fallback (roles/vllm_router with vllm_router_front_fallbacks), run inside
the test container on the ROLE-RENDERED configuration, after setup_in_container.sh (tests/gateway/run.sh
does both). Adapted from the research prototype's tests (issue #13). Plain python3: urllib/http.client
only. Prints one line per check and a closing 'N passed, N failed' line; exits 1 on a failure."""
import http.client
import json
import os
import pwd
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

FRONT = "http://127.0.0.1:8000"
KEY = "preflight-test-client-key-00001"  # tests/preflight/good's vllm_router_api_keys
KEY2 = "preflight-test-client-key-00002"  # the second key of vars.json's vllm_router_api_keys
MODEL = "smollm2-135m-instruct"  # its served model name
with open("/gw/cloud_keys") as _f:
    CLOUD_KEYS = _f.read().split()
GW = "/tmp/gw"
RESULTS = []
SEEN = []  # everything the client received (status line, headers, body), for the key check


def check(name, ok, detail=""):
    RESULTS.append((name, bool(ok)))
    print(f"{'PASS' if ok else 'FAIL'}  {name}" + (f"  [{detail}]" if detail else ""), flush=True)


def mode(which, m):
    with open(f"{GW}/{which}_mode", "w") as f:
        f.write(m)


def lines(path):
    try:
        with open(path) as f:
            return [json.loads(x) for x in f if x.strip()]
    except FileNotFoundError:
        return []


def cloud_reqs(name):
    return lines(f"{GW}/cloud_{name}_requests.log")


def post(body, key=KEY, path="/v1/chat/completions", timeout=30):
    """One request; returns (status, headers dict lower-case, body bytes, complete?)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(FRONT + path, data=data, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}",
                                          "Accept-Encoding": "gzip"})
    complete = True
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, hdrs = r.status, {k.lower(): v for k, v in r.headers.items()}
            try:
                raw = r.read()
            except http.client.IncompleteRead as e:
                raw, complete = e.partial, False
    except urllib.error.HTTPError as e:
        status, hdrs, raw = e.code, {k.lower(): v for k, v in e.headers.items()}, e.read()
    SEEN.append(f"{status} {json.dumps(hdrs)} ".encode() + raw)
    return status, hdrs, raw, complete


def chat(stream=False, model=MODEL, content="hi"):
    return {"model": model, "stream": stream, "messages": [{"role": "user", "content": content}]}


def sse_models(raw):
    out = []
    for ln in raw.decode("utf-8", "replace").split("\n"):
        if ln.startswith("data: ") and ln != "data: [DONE]":
            out.append(json.loads(ln[6:])["model"])
    return out


def metrics():
    with urllib.request.urlopen("http://127.0.0.1:8090/fallback_metrics", timeout=5) as r:
        text = r.read().decode()
    out = {}
    for m in re.finditer(r'fallback="([^"]+)",reason="([^"]+)"\} (\d+)', text):
        out[(m.group(1), m.group(2))] = int(m.group(3))
    return out, text


def mdelta(before, after):
    return {k: after.get(k, 0) - before.get(k, 0) for k in after if after.get(k, 0) != before.get(k, 0)}


def start_local():
    p = subprocess.Popen(["python3", "/gw/fake_local.py", "18301", "18302"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    with open(f"{GW}/local.pid", "w") as f:
        f.write(str(p.pid))
    time.sleep(0.5)


def stop_local():
    try:
        with open(f"{GW}/local.pid") as f:
            os.kill(int(f.read()), signal.SIGTERM)
    except (FileNotFoundError, ProcessLookupError):
        pass
    time.sleep(0.5)


def reset():
    mode("local", "ok")
    mode("cloud_a", "ok")
    mode("cloud_b", "ok")


def main():
    reset()
    m0, _unused = metrics()

    # 1. Local path.
    s, h, b, _unused = post(chat())
    check("local ok: 200, X-Inferops-Served-By: local, model unchanged",
          s == 200 and h.get("x-inferops-served-by") == "local" and json.loads(b)["model"] == MODEL,
          f"{s} {h.get('x-inferops-served-by')}")
    s, h, b, c = post(chat(stream=True))
    check("local ok stream: served by local, every chunk's model the client's",
          s == 200 and h.get("x-inferops-served-by") == "local" and set(sse_models(b)) == {MODEL} and c)

    # 1b. No internal address to clients (issue #25): vllm-router's completion ids carry the instances'
    # addresses; the front makes them opaque, the same id in every SSE event.
    s, h, b, _unused = post(chat())
    jid = json.loads(b)["id"]
    check("local JSON: completion id opaque (prefix kept, 32 hex digits), no address",
          re.fullmatch(r"cmpl-[0-9a-f]{32}", jid) is not None and b"10.89.250." not in b and b"_addr_" not in b, jid)
    s, h, b, c = post(chat(stream=True))
    ids = [json.loads(ln[6:])["id"] for ln in b.decode().split("\n") if ln.startswith("data: {")]
    check("local SSE: every event's id opaque and the same, no address in the stream",
          len(ids) == 4 and len(set(ids)) == 1 and re.fullmatch(r"cmpl-[0-9a-f]{32}", ids[0]) is not None
          and b"10.89.250." not in b and c, str(ids[:2]))
    check("the same vllm-router id gives the same opaque id in JSON and SSE (a function of the id)", ids[0] == jid)
    # 1c. Tenant isolation of the prefix cache (vllm_router_front_cache_salt_per_key, issue #25): every
    # completion body reaches vllm-router with the key's cache_salt; a client's own salt is replaced.

    def salts_of(body, key, path="/v1/chat/completions"):
        before = len(lines(f"{GW}/local_requests.log"))
        st = post(body, key=key, path=path)[0]
        return st, [r.get("cache_salt") for r in lines(f"{GW}/local_requests.log")[before:]]
    s1, salt1 = salts_of(chat(), KEY)
    s2, salt2 = salts_of(chat(), KEY2)
    s3, salt3 = salts_of(dict(chat(), cache_salt=salt2[0] if salt2 else "x"), KEY)
    s4, salt4 = salts_of({"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}, KEY2, "/v1/completions")
    check("cache_salt: each key's own, set by the front on chat and completions (inferops-k-<12 hex>)",
          (s1, s2, s4) == (200, 200, 200) and len(salt1) == len(salt2) == len(salt4) == 1
          and re.fullmatch(r"inferops-k-[0-9a-f]{12}", salt1[0] or "") is not None
          and salt1[0] != salt2[0] and salt4 == salt2, f"{salt1} {salt2} {salt4}")
    s5, salt5 = salts_of(dict(chat(), cache_salt="end-user-1"), KEY)
    check("cache_salt: a client's own (here another key's salt) only follows its key's: its key's, '-', 32 hex",
          s3 == s5 == 200 and len(salt3) == len(salt5) == 1
          and re.fullmatch(re.escape(salt1[0] or "?") + r"-[0-9a-f]{32}", salt3[0] or "") is not None
          and not (salt3[0] or "").startswith(salt2[0] or "?") and salt5[0] != salt3[0]
          and (salt5[0] or "").startswith(f"{salt1[0]}-"), f"{salt3} {salt5} {salt1}")
    mode("local", "router_text")
    s, h, b, _unused = post(chat())
    check("vllm-router's own error text (naming a worker URL) -> a fixed JSON error, same status, no URL",
          s == 400 and h.get("content-type", "").startswith("application/json") and b"10.89.250." not in b
          and b"http://" not in b and json.loads(b)["error"]["code"] == "invalid_request", f"{s} {b[:120]!r}")
    req = urllib.request.Request(FRONT + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            s, b = r.status, r.read()
    except urllib.error.HTTPError as e:
        s, b = e.code, e.read()
    SEEN.append(b)
    check("GET /v1/models, vllm-router's 503 text naming workers -> fixed JSON 503 unavailable",
          s == 503 and json.loads(b)["error"]["code"] == "unavailable" and b"10.89.250." not in b, f"{s} {b[:120]!r}")
    mode("local", "vllm_addr")
    s, h, b, _unused = post(chat())
    msg = json.loads(b)["error"]["message"] if s == 400 else ""
    check("vLLM's own 400 (JSON) keeps its message, URLs and addresses blanked",
          s == 400 and "bad request" in msg and "10.89.250." not in msg and "<upstream>" in msg, msg)
    mode("local", "ok")

    # 2. Fallback on 503 (no healthy decode), JSON and SSE.
    mode("local", "503")
    na = len(cloud_reqs("a"))
    s, h, b, _unused = post(chat(content="h\u00e9llo \u4e16\u754c"))
    j = json.loads(b)
    cr = cloud_reqs("a")[na:]
    check("local 503 -> fallback (JSON): 200, served by fallback",
          s == 200 and h.get("x-inferops-served-by") == "fallback"
          and "cloud a" in j["choices"][0]["message"]["content"],
          f"{s} {h.get('x-inferops-served-by')}")
    check("fallback JSON answer: model is the client's (the client's, the cloud said gpt-cloud-mini-2024-07-18)",
          j["model"] == MODEL, j["model"])
    check("fallback request: cloud got its own model name, our cloud key, a correct Content-Length, "
          "no client header but Accept/Content-Type (no Accept-Encoding, X-Forwarded-For)",
          len(cr) == 1 and cr[0]["model"] == "gpt-cloud-mini" and cr[0]["key_ok"] and cr[0]["body_len_ok"]
          and set(cr[0]["headers"]) <= {"Accept", "Authorization", "Content-Length", "Content-Type", "Host"}
          and cr[0]["x_forwarded_for"] is None, json.dumps(cr[-1:]))
    check("fallback answer: the cloud's headers pass by an allow-list (no Set-Cookie, openai-*, x-ratelimit-*, "
          "x-request-id), Content-Type kept",
          not [k for k in h if k.startswith(("set-cookie", "openai-", "x-ratelimit", "x-request-id"))]
          and h.get("content-type", "").startswith("application/json"), str(sorted(h)))
    s, h, b, c = post(chat(stream=True))
    models = sse_models(b)
    check("local 503 -> fallback (SSE): 200, served by fallback, complete stream",
          s == 200 and h.get("x-inferops-served-by") == "fallback" and c and b.rstrip().endswith(b"data: [DONE]"))
    check("fallback SSE: every chunk's model is the client's (events split across reads, UTF-8 split)",
          len(models) == 4 and set(models) == {MODEL}, str(models))
    text = "".join(json.loads(ln[6:])["choices"][0]["delta"].get("content", "")
                   for ln in b.decode().split("\n") if ln.startswith("data: {"))
    check("fallback SSE: content intact (non-ASCII too)", text == "cloud says h\u00e9llo \u4e16\u754c", text)

    # The fallback's stream goes out as it comes (the filter holds back only an incomplete line).
    c = http.client.HTTPConnection("127.0.0.1", 8000, timeout=10)
    t0 = time.monotonic()
    c.request("POST", "/v1/chat/completions", body=json.dumps(chat(stream=True)),
              headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    r = c.getresponse()
    first = r.readline()
    t_first = time.monotonic() - t0
    rest = r.read()
    t_all = time.monotonic() - t0
    c.close()
    SEEN.append(first + rest)
    check("fallback SSE is streamed: first event long before the last (cloud sends over ~0.25 s)",
          first.startswith(b"data: ") and t_all - t_first > 0.15, f"first {t_first:.3f}s, all {t_all:.3f}s")

    # 3. Other 5xx and the local service's own 429.
    for m in ("500", "502", "429"):
        mode("local", m)
        s, h, b, _unused = post(chat())
        check(f"local {m} -> fallback", s == 200 and h.get("x-inferops-served-by") == "fallback",
              f"{s} {h.get('x-inferops-served-by')}")

    # 4. No fallback on client errors.
    for m in ("400", "401", "404"):
        mode("local", m)
        na = len(cloud_reqs("a"))
        s, h, b, _unused = post(chat())
        check(f"local {m} -> passed to the client as is, no fallback",
              s == int(m) and h.get("x-inferops-served-by") == "local" and b"local says" in b
              and len(cloud_reqs("a")) == na, f"{s} {h.get('x-inferops-served-by')}")
    mode("local", "ok")
    na = len(cloud_reqs("a"))
    s, h, b, _unused = post(chat(), key="wrong-key")
    check("front's own 401 (bad client key): 401, no fallback", s == 401 and len(cloud_reqs("a")) == na, str(s))
    s, h, b, _unused = post(chat(), path="/v1/workers")
    check("unknown route: 404, no fallback", s == 404 and len(cloud_reqs("a")) == na, str(s))

    # 5. A stream that started is never switched.
    mode("local", "stream_die")
    na = len(cloud_reqs("a"))
    s, h, b, c = post(chat(stream=True))
    check("local stream dies after 2 chunks: client keeps the local stream (served by local), cut short, "
          "no fallback", s == 200 and h.get("x-inferops-served-by") == "local" and len(sse_models(b)) == 2
          and not c and len(cloud_reqs("a")) == na, f"{s} chunks={len(sse_models(b))} complete={c}")

    # 6. First-byte timeout (proxy_read_timeout 2 s; the local side answers after 5 s).
    mode("local", "slow")
    t = time.monotonic()
    s, h, b, _unused = post(chat())
    dt = time.monotonic() - t
    check("local silent past the first-byte timeout (2 s) -> fallback",
          s == 200 and h.get("x-inferops-served-by") == "fallback" and 1.9 < dt < 3.5, f"{s} {dt:.2f}s")
    mode("local", "ok")

    # 7. Connection refused (both router replicas down).
    stop_local()
    s, h, b, _unused = post(chat())
    check("local refused (every replica down) -> fallback", s == 200 and h.get("x-inferops-served-by") == "fallback",
          f"{s} {h.get('x-inferops-served-by')}")
    s, h, b, c = post(chat(stream=True))
    check("local refused, stream -> fallback stream, models the client's",
          s == 200 and c and set(sse_models(b)) == {MODEL})
    start_local()

    # 8. 429 from our own limit_req (20 r/s, burst 40): a burst of 70 requests.
    mode("local", "ok")
    time.sleep(2.5)  # the bucket refills
    before, _unused = metrics()
    na = len(cloud_reqs("a"))
    sts, by = [], []
    for _unused in range(70):
        s, h, b, _unused = post(chat())
        sts.append(s)
        by.append(h.get("x-inferops-served-by"))
    after, _unused = metrics()
    d = mdelta(before, after)
    # vllm_router_front_fallback_on_rate_limit: false (the default since issue #25): the key's limits hold on
    # the fallback path too; its excess gets our 429, not the cloud.
    check("burst of 70 over the key's limit: the excess gets our 429 (Retry-After), none goes to a cloud",
          sts.count(429) > 0 and sts.count(200) + sts.count(429) == 70 and by.count("fallback") == 0
          and len(cloud_reqs("a")) == na and d.get(("cloud-a", "limited"), 0) == 0,
          f"200={sts.count(200)} 429={sts.count(429)} fallback={by.count('fallback')} counter+={d}")

    # 9. Chain: first fallback down too -> second one (its own path, key, model name).
    time.sleep(2.5)
    mode("local", "503")
    mode("cloud_a", "503")
    nb = len(cloud_reqs("b"))
    s, h, b, _unused = post(chat())
    crb = cloud_reqs("b")[nb:]
    check("local 503 + cloud-a 503 -> cloud-b: 200, its path /openai/v1/..., its model name, its key, "
          "answer's model the client's",
          s == 200 and h.get("x-inferops-served-by") == "fallback" and json.loads(b)["model"] == MODEL
          and len(crb) == 1 and crb[0]["path"] == "/openai/v1/chat/completions" and crb[0]["model"] == "other-model"
          and crb[0]["key_ok"], json.dumps(crb))
    # 10. A fallback refusing our key: its 401 body quotes the key; the client never sees it.
    mode("cloud_a", "401")
    s, h, b, _unused = post(chat())
    check("cloud-a answers 401 (quoting the key) -> next endpoint serves, key not in the answer",
          s == 200 and h.get("x-inferops-served-by") == "fallback" and not any(k.encode() in b for k in CLOUD_KEYS),
          str(s))
    mode("cloud_b", "401")
    s, h, b, _unused = post(chat())
    check("every endpoint 401: client gets 502 fallback_unavailable, no key in the answer",
          s == 502 and b"fallback_unavailable" in b and not any(k.encode() in b for k in CLOUD_KEYS), f"{s} {b[:80]!r}")
    mode("cloud_b", "503")
    s, h, b, _unused = post(chat())
    check("local and every endpoint 503: client gets the last endpoint's 503", s == 503, str(s))
    mode("cloud_a", "400")
    mode("cloud_b", "ok")
    s, h, b, _unused = post(chat())
    check("a fallback's 400 (client error) is the answer, not tried on the next endpoint",
          s == 400 and h.get("x-inferops-served-by") == "fallback", str(s))
    reset()

    # 11. Large body (2 MiB, over client_body_buffer_size 1m: nginx keeps it in a temp file).
    mode("local", "503")
    big = "x" * (2 * 1024 * 1024) + " \u00e9\u4e16"
    na = len(cloud_reqs("a"))
    s, h, b, _unused = post(chat(content=big))
    cr = cloud_reqs("a")[na:]
    check("2 MiB body (over the old 1m buffer) -> fallback gets it whole with its model name",
          s == 200 and len(cr) == 1 and cr[0]["model"] == "gpt-cloud-mini" and cr[0]["body_len_ok"]
          and cr[0]["messages_len"] == len(json.dumps([{"role": "user", "content": big}])),
          f"{s} {json.dumps(cr)[:200]}")
    s, h, b, _unused = post(chat(content="y" * (5 * 1024 * 1024)))
    check("5 MiB body, over the fallback's limit (4 MiB): 503 saying so, nothing sent to the cloud",
          s == 503 and b"larger than the fallback accepts" in b and len(cloud_reqs("a")) == na + 1, str(s))
    s, h, b, _unused = post(b"this is not json")
    check("body not JSON -> passed on as it is (the endpoint's 400 is the answer)", s == 400, str(s))
    mode("local", "ok")

    # 12. TLS verification: with a CA that did not sign the endpoint's certificate, no fallback.
    shutil.copy("/etc/nginx/inferops-test-ca.pem", f"{GW}/ca.keep")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=other",
                    "-keyout", f"{GW}/other.key", "-out", "/etc/nginx/inferops-test-ca.pem"], check=True,
                   capture_output=True)
    subprocess.run(["nginx", "-s", "reload"], check=True, capture_output=True)
    time.sleep(1)
    mode("local", "503")
    na = len(cloud_reqs("a"))
    s, h, b, _unused = post(chat())
    err = open("/var/log/nginx/inferops-vllm.error.log").read()
    check("endpoint certificate not trusted -> not used (503 unavailable), error log says why",
          s == 503 and b"unavailable" in b and len(cloud_reqs("a")) == na and "certificate verify" in err, str(s))
    shutil.copy(f"{GW}/ca.keep", "/etc/nginx/inferops-test-ca.pem")
    subprocess.run(["nginx", "-s", "reload"], check=True, capture_output=True)
    time.sleep(1)
    mode("local", "ok")

    # 13. Cost controls (issue #25): only mapped models, no query string, the max_tokens cap, the budget.
    mode("local", "503")
    na = len(cloud_reqs("a"))
    s, h, b, _unused = post(chat(model="gpt-4-unknown"))
    j = json.loads(b) if s == 404 else {}
    check("a model the endpoint does not map (not served here): vLLM's 404 shape, nothing sent to a cloud",
          s == 404 and j.get("error", {}).get("code") == 404 and j["error"].get("type") == "NotFoundError"
          and "gpt-4-unknown" in j["error"].get("message", "") and len(cloud_reqs("a")) == na, f"{s} {b[:120]!r}")
    s, h, b, _unused = post(chat(), path="/v1/chat/completions?api-version=2024-01-01&user=x")
    cr = cloud_reqs("a")[na:]
    check("the client's query string is dropped on the way to the cloud",
          s == 200 and len(cr) == 1 and cr[0]["path"] == "/v1/chat/completions", json.dumps(cr[-1:]))
    body = chat()
    body.update(max_tokens=1000, n=2)
    post(body)
    post(chat())
    cr = cloud_reqs("a")[na + 1:]
    check("max_tokens cap (100 for cloud-a): 1000 x n=2 -> 50 each; absent -> 100",
          len(cr) == 2 and (cr[0]["max_tokens"], cr[0]["n"]) == (50, 2) and cr[1]["max_tokens"] == 100,
          json.dumps([(x["max_tokens"], x["n"]) for x in cr]))
    # The budget: cloud-a 1000 requests a minute, cloud-b 20 (vars.json), counted in one file per endpoint and
    # minute. The files are filled up to just below the budget (the counting itself is what is tested).
    if time.time() % 60 > 45:
        time.sleep(61 - time.time() % 60)
    minute = int(time.time() // 60)
    budget = "/var/lib/nginx/inferops-vllm-budget"
    www = pwd.getpwnam("www-data")
    for name, count in (("cloud-a", 1000), ("cloud-b", 18)):
        with open(f"{budget}/{name}.{minute}", "w") as f:
            f.write("." * count)
        os.chown(f"{budget}/{name}.{minute}", www.pw_uid, www.pw_gid)  # nginx's workers append to it
    na, nb = len(cloud_reqs("a")), len(cloud_reqs("b"))
    got = [post(chat()) for _unused in range(3)]
    check("cloud-a's budget spent -> cloud-b serves (its 19th and 20th requests of the minute)",
          [g[0] for g in got[:2]] == [200, 200] and len(cloud_reqs("a")) == na and len(cloud_reqs("b")) == nb + 2,
          str([g[0] for g in got]))
    s, h, b = got[2][0], got[2][1], got[2][2]
    check("every endpoint's budget spent -> our 429 fallback_budget_exhausted with Retry-After, no cloud request",
          s == 429 and b"fallback_budget_exhausted" in b and h.get("retry-after") == "60"
          and len(cloud_reqs("b")) == nb + 2, f"{s} {b[:100]!r} {h.get('retry-after')}")
    for name in ("cloud-a", "cloud-b"):
        os.unlink(f"{budget}/{name}.{minute}")
    mode("local", "ok")

    # 14. 0 failed requests while the local pool goes down, stays down and comes back.
    time.sleep(2.5)
    fails, served, lock = [], {"local": 0, "fallback": 0}, threading.Lock()
    stop_at = time.monotonic() + 9

    def client(stream):
        while time.monotonic() < stop_at:
            try:
                s, h, b, c = post(chat(stream=stream), key=KEY)
                ok = s == 200 and c and (not stream or set(sse_models(b)) == {MODEL})
                with lock:
                    served[h.get("x-inferops-served-by")] = served.get(h.get("x-inferops-served-by"), 0) + 1
                    if not ok:
                        fails.append((s, stream))
            except Exception as e:  # noqa: BLE001
                with lock:
                    fails.append((repr(e), stream))
            # Below the key's own limit (20 r/s, burst 40) with both clients: over it, the key gets our 429
            # (vllm_router_front_fallback_on_rate_limit: false, the default).
            time.sleep(0.12)
    th = [threading.Thread(target=client, args=(x,)) for x in (False, True)]
    for t in th:
        t.start()
    time.sleep(2.5)
    mode("local", "503")      # no healthy decode: the router answers 503 (running streams finish)
    time.sleep(1.5)
    stop_local()              # then every replica gone: connection refused
    time.sleep(2.5)
    mode("local", "ok")
    start_local()             # back
    for t in th:
        t.join()
    check("local pool 503, then killed, then back, under load (9 s, JSON + SSE clients): 0 failed requests",
          not fails and served["local"] > 0 and served["fallback"] > 0, f"served={served} fails={fails[:5]}")

    # 14b. Endpoint names are resolved per request, not at start: with the DNS server down, nginx
    # still starts and serves locally; the fallback is unavailable (JSON 503) until DNS answers again,
    # without a restart.
    time.sleep(2.5)
    with open(f"{GW}/dnsmasq.pid") as f:
        os.kill(int(f.read()), signal.SIGTERM)
    time.sleep(0.5)
    subprocess.run(["nginx", "-s", "quit"], check=True, capture_output=True)
    for _unused in range(50):
        if not os.path.exists("/run/nginx.pid"):
            break
        time.sleep(0.1)
    started = subprocess.run(["nginx"], capture_output=True, text=True, check=False)
    time.sleep(0.5)
    mode("local", "ok")
    s, h, b, _unused = post(chat())
    check("DNS down: nginx starts all the same (names resolved per request) and serves locally",
          started.returncode == 0 and s == 200 and h.get("x-inferops-served-by") == "local",
          f"start rc={started.returncode} {started.stderr.strip()[:120]} -> {s}")
    mode("local", "503")
    t = time.monotonic()
    s, h, b, _unused = post(chat())
    check("DNS down, local 503: JSON 503 unavailable (no endpoint resolves), within the resolver timeout",
          s == 503 and b"unavailable" in b and time.monotonic() - t < 12, f"{s} {b[:80]!r} {time.monotonic() - t:.1f}s")
    subprocess.run(["dnsmasq", "--port=5353", "--listen-address=127.0.0.1", "--bind-interfaces", "--no-resolv",
                    "--no-hosts", "--local=/cloud.test/", "--address=/cloud.test/127.0.0.1",
                    f"--pid-file={GW}/dnsmasq.pid"], check=True)
    time.sleep(0.5)
    s, h, b, _unused = post(chat())
    check("DNS back: the fallback serves again, without an nginx restart or reload",
          s == 200 and h.get("x-inferops-served-by") == "fallback", f"{s} {h.get('x-inferops-served-by')}")
    mode("local", "ok")

    # 15. The counter, readable over HTTP, agrees with the fallback log.
    m1, text = metrics()
    d = mdelta(m0, m1)
    logged = open("/var/log/nginx/inferops-vllm.fallback.log").read().count("\n")
    check("fallback counter on 127.0.0.1:8090/fallback_metrics: one tick per fallback (= lines of the fallback log)",
          sum(m1.values()) == logged and sum(d.values()) > 0, f"total={sum(m1.values())} log_lines={logged} delta={d}")
    print(text, end="")

    # 16. The cloud keys: never in what the client got, nor in nginx's logs.
    got = b"\n".join(SEEN)
    logs = b""
    for f in os.listdir("/var/log/nginx"):
        with open(os.path.join("/var/log/nginx", f), "rb") as fh:
            logs += fh.read()
    for k in CLOUD_KEYS:
        check(f"cloud key {k[:9]}... never in any answer the client got ({len(SEEN)} answers)", k.encode() not in got)
        check(f"cloud key {k[:9]}... never in nginx's logs ({len(logs)} bytes in /var/log/nginx)",
              k.encode() not in logs)
    check(f"no instance address (10.89.250.x) nor vllm-router id in any answer the client got ({len(SEEN)} answers)",
          b"10.89.250." not in got and b"_addr_" not in got)
    st = os.stat("/etc/nginx/inferops-vllm-fallback-0.conf")
    check("key file is 0600 root", (st.st_mode & 0o777) == 0o600 and st.st_uid == 0, oct(st.st_mode & 0o777))

    # 17. Failed-key attempts per client address (issue #25; 60 a minute, burst 20): 401 with its
    # WWW-Authenticate, then 429 for the address; a valid key from the same address is still served.
    mode("local", "ok")
    answers = [post(chat(), key=f"wrong-key-{i:04d}-abcdefgh") for i in range(30)]
    codes = [a[0] for a in answers]
    first = answers[0]
    check("a wrong key: 401 JSON with WWW-Authenticate (answered after the per-address count)",
          first[0] == 401 and first[1].get("www-authenticate", "").startswith("Bearer")
          and json.loads(first[2])["error"]["code"] == "invalid_api_key", f"{first[0]} {first[1]}")
    limited = [a for a in answers if a[0] == 429]
    check("30 wrong keys at once from one address: the burst gets 401, the rest 429 too_many_failed_keys",
          18 <= codes.count(401) <= 23 and codes.count(401) + len(limited) == 30 and limited
          and json.loads(limited[0][2])["error"]["code"] == "too_many_failed_keys"
          and limited[0][1].get("retry-after") == "60", f"401={codes.count(401)} 429={len(limited)}")
    s, h, b, _unused = post(chat())
    check("the same address with a valid key is still served (valid keys are not counted)", s == 200, str(s))

    # 18. /health for load balancers follows vllm-router's /readiness (issue #24): 200 while a prefill and a
    # decode instance are healthy, "degraded" when some instance is out, 503 when no pair is or no replica answers;
    # the body names nothing, and the client's key is not needed.
    def health():
        try:
            with urllib.request.urlopen(FRONT + "/health", timeout=10) as resp:
                return resp.status, resp.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    for state, want in (("ok", (200, b"ok\n")), ("degraded", (200, b"degraded\n")),
                        ("none", (503, b"unavailable\n")), ("garbage", (503, b"unavailable\n"))):
        mode("readiness", state)
        got = health()
        check(f"/health with /readiness {state}: {want[0]} {want[1]!r}", got == want, str(got))
    mode("readiness", "degraded")
    stop_local()
    got = health()
    check("/health with no router replica answering: 503 unavailable", got == (503, b"unavailable\n"), str(got))
    start_local()
    mode("readiness", "ok")

    reset()
    passed = sum(1 for _unused, ok in RESULTS if ok)
    print(f"{passed} passed, {len(RESULTS) - passed} failed")
    sys.exit(0 if passed == len(RESULTS) else 1)


if __name__ == "__main__":
    main()
