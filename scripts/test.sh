#!/usr/bin/env bash
# The README's test command: installs what it needs (sandbox, tools), then runs lint, unit
# tests and the molecule scenarios against real vLLM in Podman containers.
# INFEROPS_TEST_STAGES limits the stages (space-separated: lint unit molecule).
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"

stages="${INFEROPS_TEST_STAGES:-lint unit molecule}"
start=$(date +%s)
stage() { printf '\n\033[1m== %s\033[0m (t+%ss)\n' "$*" "$(( $(date +%s) - start ))"; }

stage "sandbox and tools"
"$REPO_ROOT/scripts/sandbox/setup.sh" all
bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
export PATH="$bin:$PATH"
export_sandbox_env
export ANSIBLE_FORCE_COLOR=0 PY_COLORS=0
cd "$REPO_ROOT"

# molecule installs a copy of the collection under test into ~/.ansible/collections; a stale one
# from an earlier run would shadow this checkout for ansible-lint.
rm -rf "$HOME/.ansible/collections/ansible_collections/inferops/vllm"

if [[ " $stages " == *" lint "* ]]; then
  stage "lint: yamllint, ansible-lint (production profile), ruff"
  yamllint --strict .
  ansible-lint --offline
  ruff check .
fi

if [[ " $stages " == *" unit "* ]]; then
  stage "unit tests"
  pytest -q tests/unit
fi

if [[ " $stages " == *" molecule "* ]]; then
  for scenario in default; do
    stage "molecule test -s $scenario"
    molecule test -s "$scenario"
  done
fi

stage "all stages passed: $stages"
