#!/usr/bin/env bash
# The README's main command: prepare the sandbox, start its hosts (Podman containers with
# systemd, named as in inventories/sandbox/hosts.yml) and run deploy_pd.yml against them.
# Extra arguments go to ansible-playbook (e.g. --check --diff). Stop it all with down.sh.
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$REPO_ROOT/scripts/sandbox/setup.sh" all
bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
export PATH="$bin:$PATH"
export_sandbox_env

network=inferops-sandbox
podman network exists "$network" || podman network create "$network" >/dev/null
for name in inferops-prefill-1 inferops-decode-1 inferops-router-1; do
  # Hosts from before the firewall role lack NET_ADMIN (nftables): start them afresh.
  if podman container exists "$name" &&
    ! podman inspect -f '{{.HostConfig.CapAdd}}' "$name" | grep -q NET_ADMIN; then
    log "recreating sandbox host $name with NET_ADMIN (needed for the firewall rules)"
    podman rm -f "$name" >/dev/null
  fi
  if ! podman container exists "$name"; then
    log "starting sandbox host $name"
    podman run -d --name "$name" --hostname "$name" --network "$network" --systemd=always \
      --shm-size=1g --cap-add NET_ADMIN \
      "$BASE_IMAGE" /sbin/init >/dev/null
  elif [ "$(podman inspect -f '{{.State.Running}}' "$name")" != true ]; then
    podman start "$name" >/dev/null
  fi
done

cd "$REPO_ROOT"
exec ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox "$@"
