#!/usr/bin/env bash
# Remove the sandbox hosts started by up.sh (the caches stay).
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
for name in inferops-prefill-1 inferops-decode-1 inferops-router-1; do
  podman container exists "$name" && podman rm -f -t 5 "$name" >/dev/null && log "removed $name"
done
podman network exists "$SANDBOX_NETWORK" && podman network rm "$SANDBOX_NETWORK" >/dev/null
exit 0
