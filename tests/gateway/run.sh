#!/usr/bin/env bash
# The front's fallback semantics against real nginx 1.22 + njs 0.7.9 (Debian 12's packages), on the
# configuration the vllm_router role renders (tests/gateway/render.yml on tests/preflight/good with
# vars.json). Needs podman and the local image below; not part of the unit stage.
#   bash tests/gateway/run.sh            # renders, starts the container, runs the tests, removes it
#   KEEP=1 bash tests/gateway/run.sh     # leaves the container running (to look around)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$REPO/tests/gateway"
NAME="${INFEROPS_GATEWAY_CONTAINER:-inferops-gateway-test}"
IMAGE="${INFEROPS_GATEWAY_IMAGE:-${INFEROPS_BASE_IMAGE:-localhost/inferops-vllm-base:debian12-systemd-v2}}"
tools="$(bash "$REPO/scripts/sandbox/tools.sh")"
export PATH="$tools:$PATH"
export ANSIBLE_COLLECTIONS_PATH="${ANSIBLE_COLLECTIONS_PATH:-$REPO/.ansible/collections}"
work="$(mktemp -d)"
trap 'rm -rf "$work"; [ -n "${KEEP:-}" ] || podman rm -f "$NAME" >/dev/null 2>&1 || true' EXIT

echo "== render the front with the role (ansible-playbook, no host contacted)"
ansible-playbook -i "$REPO/tests/preflight/good" "$HERE/render.yml" -e "@$HERE/vars.json" \
  -e "out_dir=$work/out" -e "ansible_python_interpreter=$(command -v python3)" >"$work/render.log" \
  || { cat "$work/render.log"; exit 1; }
python3 -c 'import json,sys; v=json.load(open(sys.argv[1])); print(*(f["api_key"] for f in v["vllm_router_front_fallbacks"]))' \
  "$HERE/vars.json" >"$work/cloud_keys"
# The role's own check of the site before it goes live (the site entry's validate in the task that writes the front's
# files: _vllm_router_nginx_site_check of the role's vars).
python3 - "$REPO/roles/vllm_router" >"$work/validate.sh" <<'PY'
import sys, yaml
role = sys.argv[1]
(task,) = [t for t in yaml.safe_load(open(role + "/tasks/configure.yml"))
           if t.get("name", "").startswith("Write the front's client keys")]
assert "'validate': _vllm_router_nginx_site_check" in task["inferops.vllm.config_files"]["files"], task
check = yaml.safe_load(open(role + "/vars/main.yml"))["_vllm_router_nginx_site_check"]
print(check.replace("%s", "/etc/nginx/sites-available/inferops-vllm.conf"))
PY

echo "== container $NAME from $IMAGE"
if ! podman container exists "$NAME"; then
  podman run -d --name "$NAME" --cpus 1 "$IMAGE" sleep infinity >/dev/null
fi
if ! podman exec "$NAME" test -e /usr/lib/nginx/modules/ngx_http_js_module.so; then
  podman exec "$NAME" bash -c 'apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
    nginx-light libnginx-mod-http-js python3 openssl curl dnsmasq-base >/dev/null'
fi
podman exec "$NAME" bash -c 'rm -rf /gw && mkdir -p /gw'
podman cp "$work/out/router-1" "$NAME:/gw/rendered"
podman cp "$work/cloud_keys" "$NAME:/gw/cloud_keys"
podman cp "$work/validate.sh" "$NAME:/gw/validate.sh"
for f in setup_in_container.sh fake_local.py fake_cloud.py test_semantics.py; do podman cp "$HERE/$f" "$NAME:/gw/$f"; done
podman exec "$NAME" bash -c 'nginx -v 2>&1; dpkg-query -W libnginx-mod-http-js'
echo "== nginx -t on the rendered configuration, and start"
podman exec "$NAME" bash /gw/setup_in_container.sh
echo "== semantics"
podman exec "$NAME" python3 /gw/test_semantics.py
