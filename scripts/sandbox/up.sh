#!/usr/bin/env bash
# The README's main command: prepare the sandbox, start its hosts (Podman containers with
# systemd, named and addressed as in inventories/sandbox/hosts.yml, reached over SSH like real
# hosts) and run deploy_pd.yml against them.
# Extra arguments go to ansible-playbook (e.g. --check --diff). Stop it all with down.sh.
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

"$REPO_ROOT/scripts/sandbox/setup.sh" all
bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
export PATH="$bin:$PATH"
export_sandbox_env
cd "$REPO_ROOT"

# Host name -> address, from the inventory (its ansible_host values).
mapfile -t hosts < <(ansible-inventory -i inventories/sandbox --list | python3 -c '
import json, sys
inv = json.load(sys.stdin)
for name, hostvars in sorted(inv["_meta"]["hostvars"].items()):
    print(name, hostvars["ansible_host"])')

# A network from before the fixed addresses (or another subnet) is replaced, with its hosts.
if podman network exists "$SANDBOX_NETWORK" &&
  ! podman network inspect -f '{{range .Subnets}}{{.Subnet}} {{end}}' "$SANDBOX_NETWORK" | grep -qw "$SANDBOX_SUBNET"; then
  log "recreating network $SANDBOX_NETWORK with subnet $SANDBOX_SUBNET (the hosts' fixed addresses)"
  for entry in "${hosts[@]}"; do podman rm -f -t 5 "${entry%% *}" >/dev/null 2>&1 || true; done
  podman network rm "$SANDBOX_NETWORK" >/dev/null
fi
podman network exists "$SANDBOX_NETWORK" || podman network create --subnet "$SANDBOX_SUBNET" "$SANDBOX_NETWORK" >/dev/null

for entry in "${hosts[@]}"; do
  name="${entry%% *}" address="${entry#* }"
  # Hosts from an older base image (no sshd, no NET_ADMIN for the firewall) are started afresh.
  if podman container exists "$name" &&
    { [ "$(podman inspect -f '{{.ImageName}}' "$name")" != "$BASE_IMAGE" ] ||
      ! podman inspect -f '{{.HostConfig.CapAdd}}' "$name" | grep -q NET_ADMIN; }; then
    log "recreating sandbox host $name from $BASE_IMAGE"
    podman rm -f -t 5 "$name" >/dev/null
  fi
  if ! podman container exists "$name"; then
    log "starting sandbox host $name ($address)"
    podman run -d --name "$name" --hostname "$name" --network "$SANDBOX_NETWORK" --ip "$address" \
      --systemd=always --shm-size=1g --cap-add NET_ADMIN "$BASE_IMAGE" /sbin/init >/dev/null
  elif [ "$(podman inspect -f '{{.State.Running}}' "$name")" != true ]; then
    podman start "$name" >/dev/null
  fi
  podman exec -i "$name" sh -c 'install -d -m 0700 /root/.ssh && cat >/root/.ssh/authorized_keys &&
    chmod 0600 /root/.ssh/authorized_keys' <"$SANDBOX_SSH_KEY.pub"
  for _ in $(seq 60); do
    ssh -q -i "$SANDBOX_SSH_KEY" -o BatchMode=yes -o StrictHostKeyChecking=no -o UserKnownHostsFile=/dev/null \
      -o ConnectTimeout=2 "root@$address" true && continue 2
    sleep 0.5
  done
  die "sandbox host $name does not answer SSH on $address (podman exec $name journalctl -u ssh)"
done

log "other playbooks, in any shell: source scripts/sandbox/env.sh; ansible-playbook playbooks/<playbook>.yml -i inventories/sandbox"
exec ansible-playbook playbooks/deploy_pd.yml -i inventories/sandbox "$@"
