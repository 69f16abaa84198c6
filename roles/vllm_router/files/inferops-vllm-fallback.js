// inferops.vllm front (roles/vllm_router, installed as /etc/nginx/njs/inferops-vllm-fallback.js): the fallback side of "one key, local first, cloud as fallback" (issue #13).
// Written for njs 0.7.9 (Debian 12's libnginx-mod-http-js): ES5.1 plus what njs 0.7 adds
// (let/const, arrow functions, Buffer, fs). On the local path only localHeaders/localBody
// (vllm_router_front_hide_internals) and saltedBody (vllm_router_front_cache_salt_per_key) run; the rest only
// in the fallback named locations (and for the metrics page).
//
//   fallbackBody  js_set: the client's JSON body with "model" mapped to the fallback's name
//                 (map in $inferops_fallback_models, JSON). Remembers the client's model name in
//                 $inferops_client_model (a js_var) for the response filter.
//   headers       js_header_filter: the answer's length changes, so no Content-Length.
//   body          js_body_filter (buffer_type=buffer): "model":"<theirs>" -> "model":"<client's>",
//                 in a JSON answer (whole, at its end) and in each SSE event (per complete line,
//                 so an event split across reads, or a UTF-8 sequence split across reads, is fine).
//   tooBig        js_set: '1' when the body is larger than the fallback's limit (refused, 503).
//   unmapped      js_set: vLLM's 404 JSON for a model the endpoint's map does not name ('' when it does):
//                 only mapped models are sent to a cloud (issue #25).
//   overBudget    js_set: '1' when the endpoint's requests of this minute exceed $inferops_fallback_rpm
//                 (counted in one file per endpoint and minute, like the counters: njs 0.7.9 has no
//                 shared memory).
//   localHeaders  js_header_filter of the local routes (issue #25): the body changes, so no Content-Length;
//                 an error answer is JSON.
//   localBody     js_body_filter of the local routes: completion ids ("cmpl-___prefill_addr_<ip:port>...")
//                 become opaque ids (the prefix and 32 hex digits of the id's SHA-256, the same in every SSE
//                 event of a stream); an error body from vllm-router (text, or JSON without
//                 error.message) becomes a fixed JSON error, and URLs and addresses in vLLM's error
//                 messages are blanked.
//   metrics       js_content: Prometheus text of the fallback counters (sizes of the tick files).
//   saltedBody    js_set of /v1/completions and /v1/chat/completions with vllm_router_front_cache_salt_per_key
//                 (issue #25): the client's JSON body with "cache_salt" set to the key's salt (followed by a hash
//                 of the client's own salt, if it sent one), so a key hits, and can time, only prefixes its own
//                 requests cached.

import fs from 'fs';
import crypto from 'crypto';

const MODEL_RE = /"model"\s*:\s*"(?:[^"\\]|\\.)*"/g;
const COUNT_DIR = '/var/log/nginx';
const COUNT_RE = /^inferops-vllm-fallback\.([A-Za-z0-9_-]+)\.([a-z0-9_]+)\.count$/;
// Each fallback counted writes one line of 2 bytes (".\n") to its tick file.
const TICK = 2;

// The body must be in memory: nginx unlinks its temporary body file as soon as it has opened it
// (unless client_body_in_file_only), so a body that went to a file cannot be read back by name.
// client_body_buffer_size >= the largest body a fallback takes keeps it in memory; tooBig()
// refuses larger ones before the body is needed.
function requestBody(r) {
    return r.requestText;
}

// js_set for an `if` in each fallback location: '1' when the request declares a body larger than
// $inferops_fallback_max_body (bytes), '' otherwise.
function tooBig(r) {
    const max = parseInt(r.variables.inferops_fallback_max_body || '0', 10);
    const len = parseInt(r.headersIn['Content-Length'] || '0', 10);
    return max > 0 && len > max ? '1' : '';
}

// vLLM's answer for a model it does not serve (the local side's 404), for a model no endpoint maps.
function unmapped(r) {
    let req;
    try {
        req = JSON.parse(requestBody(r) || '');
    } catch (e) {
        return '';
    }
    if (req === null || typeof req !== 'object' || typeof req.model !== 'string') {
        return '';
    }
    let map = {};
    try {
        map = JSON.parse(r.variables.inferops_fallback_models || '{}');
    } catch (e) {
        return '';
    }
    if (Object.prototype.hasOwnProperty.call(map, req.model)) {
        return '';
    }
    return JSON.stringify({error: {message: 'The model `' + req.model + '` does not exist.',
        type: 'NotFoundError', param: 'model', code: 404}}) + '\n';
}

// The endpoint's budget of requests per minute ($inferops_fallback_rpm, 0 = none): one byte appended per
// request to <dir>/<endpoint>.<minute> (O_APPEND: concurrent workers do not lose counts); its size is the
// minute's count. The file of two minutes ago is removed on the way.
function overBudget(r) {
    const rpm = parseInt(r.variables.inferops_fallback_rpm || '0', 10);
    if (!(rpm > 0)) {
        return '';
    }
    const dir = r.variables.inferops_fallback_budget_dir;
    const name = r.variables.inferops_fallback_name;
    const minute = Math.floor(Date.now() / 60000);
    const file = dir + '/' + name + '.' + minute;
    let count;
    try {
        fs.appendFileSync(file, '.');
        count = fs.statSync(file).size;
    } catch (e) {
        // A budget that cannot be counted is spent: the cloud key is not used unbounded.
        r.error('inferops fallback budget: ' + e.message);
        return '1';
    }
    try {
        fs.unlinkSync(dir + '/' + name + '.' + (minute - 2));
    } catch (e) {
        // ENOENT: already removed.
    }
    return count > rpm ? '1' : '';
}

// The endpoint's max_tokens cap ($inferops_fallback_max_tokens, 0 = none) on the whole request: max_tokens
// (and max_completion_tokens) at most cap / n, set to it when absent; n at most the cap.
function capTokens(r, req) {
    const cap = parseInt(r.variables.inferops_fallback_max_tokens || '0', 10);
    if (!(cap > 0)) {
        return;
    }
    let n = typeof req.n === 'number' && req.n >= 1 ? Math.floor(req.n) : 1;
    if (n > cap) {
        n = cap;
        req.n = n;
    }
    const each = Math.max(1, Math.floor(cap / n));
    ['max_tokens', 'max_completion_tokens'].forEach((k) => {
        if (typeof req[k] !== 'number' || req[k] > each) {
            if (k === 'max_tokens' || typeof req[k] === 'number') {
                req[k] = each;
            }
        }
    });
}

function fallbackBody(r) {
    let text;
    try {
        text = requestBody(r);
    } catch (e) {
        r.error('inferops fallback: request body unavailable: ' + e.message);
        return '';
    }
    if (text === undefined || text === null) {
        return '';
    }
    let req;
    try {
        req = JSON.parse(text);
    } catch (e) {
        // Not JSON: pass it on as it is, the endpoint answers 400 like the local side would.
        return text;
    }
    if (req === null || typeof req !== 'object' || typeof req.model !== 'string') {
        return text;
    }
    let map = {};
    try {
        map = JSON.parse(r.variables.inferops_fallback_models || '{}');
    } catch (e) {
        r.error('inferops fallback: bad $inferops_fallback_models');
    }
    r.variables.inferops_client_model = req.model;
    if (Object.prototype.hasOwnProperty.call(map, req.model)) {
        req.model = map[req.model];
    }
    capTokens(r, req);
    return JSON.stringify(req);
}

// Per-request state of the response filter (njs 0.7 clones its VM for each request, so a module
// variable lives exactly as long as one request: this is also why it cannot count across them).
let pending = null;
let sse = false;

// The cloud's response headers the client gets (lower case); every other one is removed (x-ratelimit-*,
// openai-version, cookies, request ids, ...). nginx adds its own Date and Connection after this filter.
const FALLBACK_HEADERS = {'content-type': 1, 'cache-control': 1, 'retry-after': 1, 'x-inferops-served-by': 1,
    'strict-transport-security': 1};

function headers(r) {
    delete r.headersOut['Content-Length'];
    const ct = r.headersOut['Content-Type'] || '';
    sse = ct.indexOf('text/event-stream') === 0;
    const names = Object.keys(r.headersOut);
    for (let i = 0; i < names.length; i++) {
        if (!FALLBACK_HEADERS[names[i].toLowerCase()]) {
            delete r.headersOut[names[i]];
        }
    }
}

function rewrite(r, s) {
    const model = r.variables.inferops_client_model;
    if (!model) {
        return s;
    }
    const repl = '"model":' + JSON.stringify(model);
    return s.replace(MODEL_RE, repl);
}

function body(r, data, flags) {
    const buf = pending ? Buffer.concat([pending, data]) : data;
    if (!sse) {
        // A JSON answer (or error): rewritten whole, at its end (a few KB).
        if (flags.last) {
            pending = null;
            r.sendBuffer(rewrite(r, buf.toString()), flags);
        } else {
            pending = buf;
        }
        return;
    }
    // SSE: pass on every complete line now, keep the rest for the next read.
    const nl = buf.lastIndexOf(10);
    if (nl < 0 && !flags.last) {
        pending = buf;
        return;
    }
    const upto = flags.last ? buf.length : nl + 1;
    pending = upto < buf.length ? buf.slice(upto) : null;
    const out = rewrite(r, buf.slice(0, upto).toString());
    r.sendBuffer(out, {last: flags.last, flush: true});
}

// --- The local routes (issue #25) -----------------------------------------------------------------

// A completion id: its prefix ("cmpl-", "chatcmpl-") and the rest, which vllm-router fills with the
// instances' addresses.
const ID_RE = /"id"\s*:\s*"((?:chat)?cmpl-)((?:[^"\\]|\\.)*)"/g;
const URL_RE = /[a-z][a-z0-9+.-]*:\/\/[^\s"'\\<>]+/gi;
const ADDR_RE = /\[?[0-9a-f]{0,4}(?::[0-9a-f]{0,4}){2,7}\]?(?::\d+)?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b/gi;
const FIXED = {
    400: ['the request is not valid', 'invalid_request_error', 'invalid_request'],
    401: ['missing or invalid API key', 'invalid_request_error', 'invalid_api_key'],
    403: ['forbidden', 'invalid_request_error', 'forbidden'],
    404: ['not found', 'invalid_request_error', 'not_found'],
    408: ['the request timed out', 'server_error', 'timeout'],
    413: ['the request is too large', 'invalid_request_error', 'too_large'],
    429: ['too many requests; retry later', 'rate_limit_error', 'rate_limited'],
};
let status = 0;

function opaque(prefix, rest) {
    return prefix + crypto.createHash('sha256').update(prefix + rest).digest('hex').slice(0, 32);
}

function scrub(text) {
    return text.replace(URL_RE, '<upstream>').replace(ADDR_RE, (m) => (m.indexOf('.') >= 0 || m.split(':').length > 2
        ? '<address>' : m));
}

function fixedError(code) {
    const f = FIXED[code] || (code >= 500 ? ['the service is unavailable; retry later', 'server_error', 'unavailable']
        : ['the request failed', 'invalid_request_error', 'request_failed']);
    return JSON.stringify({error: {message: f[0], type: f[1], code: f[2]}}) + '\n';
}

// An error answer of the local side: vLLM's own JSON (error.message) with URLs and addresses blanked, or
// a fixed JSON error in place of anything else (vllm-router's text, which can name the workers' URLs).
function localError(code, text) {
    let body;
    try {
        body = JSON.parse(text);
    } catch (e) {
        return fixedError(code);
    }
    if (body === null || typeof body !== 'object' || body.error === null || typeof body.error !== 'object'
        || typeof body.error.message !== 'string') {
        return fixedError(code);
    }
    body.error.message = scrub(body.error.message);
    return JSON.stringify(body) + '\n';
}

function rewriteIds(s) {
    return s.replace(ID_RE, (m, prefix, rest) => '"id":"' + opaque(prefix, rest) + '"');
}

function localHeaders(r) {
    delete r.headersOut['Content-Length'];
    status = r.status;
    const ct = r.headersOut['Content-Type'] || '';
    sse = status < 400 && ct.indexOf('text/event-stream') === 0;
    if (status >= 400) {
        r.headersOut['Content-Type'] = 'application/json';
    }
}

function localBody(r, data, flags) {
    const buf = pending ? Buffer.concat([pending, data]) : data;
    if (!sse) {
        if (!flags.last) {
            pending = buf;
            return;
        }
        pending = null;
        const text = buf.toString();
        r.sendBuffer(status >= 400 ? localError(status, text) : rewriteIds(text), flags);
        return;
    }
    const nl = buf.lastIndexOf(10);
    if (nl < 0 && !flags.last) {
        pending = buf;
        return;
    }
    const upto = flags.last ? buf.length : nl + 1;
    pending = upto < buf.length ? buf.slice(upto) : null;
    let out = rewriteIds(buf.slice(0, upto).toString());
    if (out.indexOf('"error"') >= 0) {
        out = scrub(out);
    }
    r.sendBuffer(out, {last: flags.last, flush: true});
}

function metrics(r) {
    const lines = [
        '# HELP inferops_vllm_front_fallbacks_total Requests the front passed to a fallback endpoint, by the endpoint that answered last and why the local service did not serve them.',
        '# TYPE inferops_vllm_front_fallbacks_total counter',
    ];
    let names = [];
    try {
        names = fs.readdirSync(COUNT_DIR);
    } catch (e) {
        r.error('inferops fallback metrics: ' + e.message);
    }
    names.sort();
    for (let i = 0; i < names.length; i++) {
        const m = names[i].match(COUNT_RE);
        if (!m) {
            continue;
        }
        let n = 0;
        try {
            n = Math.floor(fs.statSync(COUNT_DIR + '/' + names[i]).size / TICK);
        } catch (e) {
            continue;
        }
        lines.push('inferops_vllm_front_fallbacks_total{fallback="' + m[1] + '",reason="' + m[2] + '"} ' + n);
    }
    r.headersOut['Content-Type'] = 'text/plain; version=0.0.4';
    r.return(200, lines.join('\n') + '\n');
}

// The salt of the request's client: "inferops-" and its key id ("k-" + 12 hex digits of the key's SHA-256,
// the id of the access log and of the limits), or "inferops-a-" and the hex of the client's address when
// vllm_router_allow_unauthenticated serves clients without keys ($inferops_vllm_client is then
// $binary_remote_addr). Only A-Z a-z 0-9 and "-": vLLM 0.32 refuses "@", "/", "\\" and NUL, and 128+ characters.
function cacheSalt(r) {
    const id = r.variables.inferops_vllm_client || '';
    if (/^k-[0-9a-f]+$/.test(id)) {
        return 'inferops-' + id;
    }
    const raw = r.rawVariables.inferops_vllm_client;
    return 'inferops-a-' + (raw ? raw.toString('hex') : 'none');
}

// Evaluated when nginx builds the request to vllm-router (proxy_set_body), after the body was read:
// client_body_buffer_size = client_max_body_size keeps it in memory. A body njs cannot read is not
// passed on unsalted: the upstream gets an empty body (and answers 400).
function saltedBody(r) {
    let text;
    try {
        text = r.requestText;
    } catch (e) {
        text = undefined;
    }
    if (text === undefined || text === null) {
        r.error('inferops front: request body not in memory, not passed on without its cache_salt');
        return '';
    }
    let req;
    try {
        req = JSON.parse(text);
    } catch (e) {
        // Not JSON: as it is, vllm-router refuses it (400) like without the option.
        return text;
    }
    if (req === null || typeof req !== 'object' || Array.isArray(req)) {
        return text;
    }
    // A client's own salt (per end user, say) still separates its requests, but only within its key's:
    // the key's salt, "-", then 32 hex digits of the SHA-256 of the client's (57 characters in all).
    const own = req.cache_salt;
    let salt = cacheSalt(r);
    if (typeof own === 'string' && own.length > 0) {
        salt += '-' + crypto.createHash('sha256').update(own).digest('hex').slice(0, 32);
    }
    req.cache_salt = salt;
    return JSON.stringify(req);
}

// The front's /health for load balancers (issue #24): vllm-router's own /health turns 503 as soon as any one
// instance is unhealthy, which took a working front out of a load balancer. Its /readiness (read through the
// replicas) answers 200 while it counts at least one healthy prefill and one healthy decode instance, 503 with
// none. This answers 200 "ok" when every instance is healthy, 200 "degraded" when some are not but a pair is,
// and 503 "unavailable" when no pair is or no replica answers. The body names nothing.
async function health(r) {
    let ready = false;
    let whole = false;
    try {
        const reply = await r.subrequest('/_inferops_vllm_readiness');
        if (reply.status === 200) {
            const text = reply.responseText !== undefined ? reply.responseText : reply.responseBody;
            const state = JSON.parse(text || '{}');
            const count = (pool, key) => (state[pool] && typeof state[pool][key] === 'number') ? state[pool][key] : 0;
            ready = count('prefill', 'healthy') > 0 && count('decode', 'healthy') > 0;
            whole = ready && count('prefill', 'healthy') >= count('prefill', 'total')
                && count('decode', 'healthy') >= count('decode', 'total');
        }
    } catch (e) {
        r.error('inferops front health: /readiness of vllm-router was not its JSON: ' + e.message);
    }
    r.headersOut['Content-Type'] = 'text/plain';
    r.return(ready ? 200 : 503, ready ? (whole ? 'ok\n' : 'degraded\n') : 'unavailable\n');
}

export default {fallbackBody, tooBig, unmapped, overBudget, headers, body, localHeaders, localBody, metrics,
    saltedBody, health};
