#!/usr/bin/env bash
# The README's test command: installs what it needs (sandbox, tools), then runs lint, unit
# tests and the molecule scenarios against real vLLM in Podman containers.
# INFEROPS_TEST_STAGES limits the stages (space-separated: lint unit molecule).
# (Everything runs inside main(), so bash has read the whole file before it starts.)
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"

main() {
  local stages="${INFEROPS_TEST_STAGES:-lint unit molecule}" start out inv role scenario bin
  start=$(date +%s)
  stage() { printf '\n\033[1m== %s\033[0m (t+%ss)\n' "$*" "$(( $(date +%s) - start ))"; }

  stage "sandbox and tools"
  "$REPO_ROOT/scripts/sandbox/setup.sh" all
  if [[ " $stages " == *" molecule "* ]]; then "$REPO_ROOT/scripts/sandbox/setup.sh" ubuntu-image; fi
  bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
  export PATH="$bin:$PATH"
  export_sandbox_env
  export ANSIBLE_FORCE_COLOR=0 PY_COLORS=0
  cd "$REPO_ROOT"
  # molecule installs a copy of the collection under test into ~/.ansible/collections; a stale
  # one from an earlier run would shadow this checkout for ansible-lint.
  rm -rf "$HOME/.ansible/collections/ansible_collections/inferops/vllm"

  if [[ " $stages " == *" lint "* ]]; then
    stage "lint: yamllint, ansible-lint (production profile), ruff, shellcheck"
    yamllint --strict .
    ansible-lint --offline
    ruff check .
    shellcheck -x scripts/*.sh scripts/sandbox/*.sh .ci/run

    stage "ansible-test sanity"
    "$REPO_ROOT/scripts/sanity.sh"

    stage "collection: build and install the artifact, docs render, playbooks and inventories parse"
    out="$(mktemp -d)"
    ansible-galaxy collection build --force --output-path "$out" . >/dev/null
    ANSIBLE_COLLECTIONS_PATH="$out/installed" ansible-galaxy collection install --force --offline --no-deps -p "$out/installed" "$out"/inferops-vllm-*.tar.gz >/dev/null
    test -f "$out/installed/ansible_collections/inferops/vllm/roles/vllm_instance/files/inferops_vllm_launch.py"
    test ! -e "$out/installed/ansible_collections/inferops/vllm/molecule"
    rm -rf "$out"
    # Every module, filter (each documented by its .yml) and role there is: none can be forgotten.
    for module in plugins/modules/*.py; do
      ansible-doc -t module "inferops.vllm.$(basename "$module" .py)" >/dev/null
    done
    for filter in plugins/filter/*.yml; do
      ansible-doc -t filter "inferops.vllm.$(basename "$filter" .yml)" >/dev/null
    done
    for role in roles/*/; do
      ansible-doc -t role "inferops.vllm.$(basename "$role")" >/dev/null
    done
    for inv in sandbox example; do
      ansible-inventory -i "inventories/$inv" --list >/dev/null
      ansible-playbook --syntax-check -i "inventories/$inv" playbooks/*.yml >/dev/null
    done
  fi

  if [[ " $stages " == *" unit "* ]]; then
    stage "unit tests"
    pytest -q tests/unit
  fi

  if [[ " $stages " == *" molecule "* ]]; then
    # The driver scenario runs no vLLM (apt and podman exec, little CPU): it runs beside the
    # others, into a log that is shown when it ends, and then the front's fallback semantics against
    # real nginx + njs (tests/gateway/run.sh: one container, fake upstreams). The others run one at a time.
    local beside="nvidia_driver" beside_log beside_pid="" beside_rc=0
    if [ -f "molecule/$beside/molecule.yml" ]; then
      beside_log="$(mktemp)"
      stage "molecule test -s $beside, then tests/gateway/run.sh (started; run beside the next scenarios)"
      # Started after the next scenario created its network: two `podman network create` at the same
      # moment (each scenario's create) can pick the same CNI bridge, and one network then has no
      # gateway on this machine (seen: molecule's index could not bind its gateway address).
      (sleep 90 && molecule test -s "$beside" && echo "== tests/gateway/run.sh" && bash tests/gateway/run.sh) \
        >"$beside_log" 2>&1 &
      beside_pid=$!
    fi
    # molecule/default/prepare.yml starts a package index (the decode host installs from it).
    trap '"$REPO_ROOT/scripts/sandbox/index_server.sh" stop >/dev/null 2>&1 || true' EXIT
    for scenario in molecule/*/molecule.yml; do
      scenario="$(basename "$(dirname "$scenario")")"
      [ "$scenario" = "$beside" ] && continue
      stage "molecule test -s $scenario"
      molecule test -s "$scenario" || { [ -z "$beside_pid" ] || wait "$beside_pid" || true; return 1; }
    done
    if [ -n "$beside_pid" ]; then
      wait "$beside_pid" || beside_rc=$?
      stage "molecule test -s $beside and tests/gateway/run.sh (their output)"
      cat "$beside_log"; rm -f "$beside_log"
      [ "$beside_rc" -eq 0 ] || { echo "molecule test -s $beside or tests/gateway/run.sh failed (rc=$beside_rc)" >&2; return 1; }
    fi
  fi

  stage "all stages passed: $stages"
}

main "$@"
exit $?
