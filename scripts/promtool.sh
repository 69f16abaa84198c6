#!/usr/bin/env bash
# Prints the path of promtool from Debian 12's pinned prometheus package (the Prometheus that
# roles/vllm_monitoring installs), downloaded once with `apt-get download` and unpacked with
# `dpkg-deb -x` into the cache; later calls reuse it. The unit tests run `promtool check rules`
# and `promtool test rules` with it (tests/unit/test_monitoring_rules.py).
#   bash scripts/promtool.sh            -> /root/.cache/inferops-vllm/promtool/2.42.0+ds-5+deb12u1/usr/bin/promtool
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"

# Keep in step with roles/vllm_monitoring/vars/main.yml (_vllm_monitoring_prometheus_versions).
PROMETHEUS_DEB_VERSION="2.42.0+ds-5+deb12u1"

main() {
  local dir="$CACHE_DIR/promtool/$PROMETHEUS_DEB_VERSION" tmp deb
  local promtool="$dir/usr/bin/promtool"
  if [ -x "$promtool" ] && [ -f "$dir/.complete" ]; then
    printf '%s\n' "$promtool"
    return 0
  fi
  command -v apt-get >/dev/null || die "apt-get not found: promtool comes from Debian's prometheus package ($PROMETHEUS_DEB_VERSION)"
  command -v dpkg-deb >/dev/null || die "dpkg-deb not found: needed to unpack prometheus $PROMETHEUS_DEB_VERSION"
  mkdir -p "$(dirname "$dir")"
  # One download at a time: several test runs may start together.
  exec 8>"$(dirname "$dir")/.promtool.lock"
  flock 8
  if [ -x "$promtool" ] && [ -f "$dir/.complete" ]; then
    printf '%s\n' "$promtool"
    return 0
  fi
  log "downloading prometheus $PROMETHEUS_DEB_VERSION (for promtool) into $dir"
  tmp="$(mktemp -d "$(dirname "$dir")/.download.XXXXXX")"
  if ! (cd "$tmp" && apt-get download -q "prometheus=$PROMETHEUS_DEB_VERSION" >&2); then
    rm -rf "$tmp"
    die "apt-get download prometheus=$PROMETHEUS_DEB_VERSION failed: is Debian 12's main repository in apt's sources, and its lists current (apt-get update)?"
  fi
  deb="$(find "$tmp" -maxdepth 1 -name 'prometheus_*.deb' -print -quit)"
  [ -n "$deb" ] || { rm -rf "$tmp"; die "apt-get download left no prometheus_*.deb in $tmp"; }
  mkdir -p "$tmp/root"
  dpkg-deb -x "$deb" "$tmp/root"
  [ -x "$tmp/root/usr/bin/promtool" ] || { rm -rf "$tmp"; die "$deb holds no usr/bin/promtool"; }
  "$tmp/root/usr/bin/promtool" --version >/dev/null 2>&1 || { rm -rf "$tmp"; die "the promtool of $deb does not run here"; }
  touch "$tmp/root/.complete"
  rm -rf "$dir"
  mv "$tmp/root" "$dir"
  rm -rf "$tmp"
  printf '%s\n' "$promtool"
}

main "$@"
