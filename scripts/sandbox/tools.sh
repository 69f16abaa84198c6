#!/usr/bin/env bash
# Controller tools: a venv with the pinned requirements-dev.txt (cached, keyed by its hash), the
# dependency collections taken from the `ansible` package on PyPI (Galaxy is not reachable from
# our machines; the wheel bundles them), and this checkout linked as inferops.vllm so that
# ansible.cfg's collections_path resolves it. Prints the venv's bin directory.
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ANSIBLE_BUNDLE_VERSION="12.3.0"
# community.crypto: molecule makes a CA and the front's certificate with it (TLS tested for real).
BUNDLED_COLLECTIONS=(containers/podman community/general ansible/posix community/crypto)

venv="$(tools_venv_dir)"
# One build at a time: several callers (parallel test runs, a sandbox) may start together.
mkdir -p "$(dirname "$venv")"
exec 9>"$(dirname "$venv")/.tools.lock"
flock 9
if [ ! -x "$venv/bin/ansible-playbook" ]; then
  log "creating the tools venv $venv"
  rm -rf "$venv.tmp"
  python3 -m venv "$venv.tmp"
  "$venv.tmp/bin/pip" install -q --upgrade pip 2> >(quiet_pip >&2)
  "$venv.tmp/bin/pip" install -q -r "$REPO_ROOT/requirements-dev.txt" 2> >(quiet_pip >&2)
  # venv scripts hard-code the venv path in their shebangs: fix them up after the rename.
  grep -rl --null "$venv.tmp" "$venv.tmp/bin" | xargs -0 -r sed -i "s#$venv.tmp#$venv#g"
  rm -rf "$venv"; mv "$venv.tmp" "$venv"
fi

# Keyed by the bundle's version and the list taken from it: a new entry extracts afresh.
coll="$CACHE_DIR/collections/ansible-$ANSIBLE_BUNDLE_VERSION-$(printf '%s\n' "${BUNDLED_COLLECTIONS[@]}" | sha256sum | cut -c1-8)"
if [ ! -f "$coll/.complete" ]; then
  log "extracting ${BUNDLED_COLLECTIONS[*]} from ansible $ANSIBLE_BUNDLE_VERSION"
  rm -rf "$coll.tmp"; mkdir -p "$coll.tmp/dl"
  python3 -m pip download -q --no-deps -d "$coll.tmp/dl" "ansible==$ANSIBLE_BUNDLE_VERSION" \
    2> >(quiet_pip >&2)
  patterns=()
  for c in "${BUNDLED_COLLECTIONS[@]}"; do patterns+=("ansible_collections/$c/*"); done
  (cd "$coll.tmp" && python3 -m zipfile -e dl/*.whl x >/dev/null)
  mkdir -p "$coll.tmp/ansible_collections"
  for c in "${BUNDLED_COLLECTIONS[@]}"; do
    mkdir -p "$coll.tmp/ansible_collections/${c%/*}"
    mv "$coll.tmp/x/ansible_collections/$c" "$coll.tmp/ansible_collections/$c"
  done
  rm -rf "$coll.tmp/x" "$coll.tmp/dl"
  touch "$coll.tmp/.complete"
  rm -rf "$coll"; mv "$coll.tmp" "$coll"
fi

# .ansible/collections/ansible_collections/{inferops/vllm -> checkout, others -> cache}
target="$REPO_ROOT/.ansible/collections/ansible_collections"
mkdir -p "$target/inferops"
ln -sfn "$REPO_ROOT" "$target/inferops/vllm"
for c in "${BUNDLED_COLLECTIONS[@]}"; do
  mkdir -p "$target/${c%/*}"
  ln -sfn "$coll/ansible_collections/$c" "$target/$c"
done
printf '%s/bin\n' "$venv"
