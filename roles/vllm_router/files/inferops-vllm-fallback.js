// inferops.vllm front (roles/vllm_router, installed as /etc/nginx/njs/inferops-vllm-fallback.js): the fallback side of "one key, local first, cloud as fallback" (issue #13).
// Written for njs 0.7.9 (Debian 12's libnginx-mod-http-js): ES5.1 plus what njs 0.7 adds
// (let/const, arrow functions, Buffer, fs). Nothing here runs on the local path: nginx only calls
// these functions in the fallback named locations (and for the metrics page).
//
//   fallbackBody  js_set: the client's JSON body with "model" mapped to the fallback's name
//                 (map in $inferops_fallback_models, JSON). Remembers the client's model name in
//                 $inferops_client_model (a js_var) for the response filter.
//   headers       js_header_filter: the answer's length changes, so no Content-Length.
//   body          js_body_filter (buffer_type=buffer): "model":"<theirs>" -> "model":"<client's>",
//                 in a JSON answer (whole, at its end) and in each SSE event (per complete line,
//                 so an event split across reads, or a UTF-8 sequence split across reads, is fine).
//   tooBig        js_set: '1' when the body is larger than the fallback's limit (refused, 503).
//   metrics       js_content: Prometheus text of the fallback counters (sizes of the tick files).

import fs from 'fs';

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
    return JSON.stringify(req);
}

// Per-request state of the response filter (njs 0.7 clones its VM for each request, so a module
// variable lives exactly as long as one request: this is also why it cannot count across them).
let pending = null;
let sse = false;

function headers(r) {
    delete r.headersOut['Content-Length'];
    const ct = r.headersOut['Content-Type'] || '';
    sse = ct.indexOf('text/event-stream') === 0;
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

export default {fallbackBody, tooBig, headers, body, metrics};
