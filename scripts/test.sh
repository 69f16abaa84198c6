#!/usr/bin/env bash
# The README's test command: installs what it needs (sandbox, tools), then runs every stage: lint, unit
# tests and the molecule scenarios against real vLLM in Podman containers. CI (.ci/run) runs it as it is.
#
#   bash scripts/test.sh                        # everything (what CI runs)
#   bash scripts/test.sh --only unit            # one stage, or several: --only lint,unit
#   bash scripts/test.sh --only molecule --skip day2,fallback
#   bash scripts/test.sh --list                 # the stages and what each runs
#
# Stages: lint, sanity, build, unit, driver, gateway, molecule. --skip takes stages and, for the molecule
# stage, test files of molecule/default/tests (without test_ and .py: day2, fallback, ...), which that stage
# then leaves out (INFEROPS_VERIFY_SKIP; what was left out is said in the output). INFEROPS_TEST_STAGES
# (space-separated) is the same as --only. Ends with a table of each stage's time and every playbook's
# task-timing recap from the molecule verify step.
# (Everything runs inside main(), so bash has read the whole file before it starts.)
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"

ALL_STAGES="lint sanity build unit driver gateway molecule"

# The molecule/default/tests files, as --skip names them: " benchmark client_config day2 ...".
verify_files() {
  local f
  for f in "$REPO_ROOT"/molecule/default/tests/test_*.py; do f="${f##*/test_}"; printf ' %s' "${f%.py}"; done
}

usage() {
  cat <<EOF
usage: bash scripts/test.sh [--only STAGE[,STAGE...]] [--skip STAGE|FILE[,...]] [--list]

stages (all by default; sanity runs in the background beside lint, build and unit, driver and gateway beside unit;
the sandbox images, wheelhouses and model are made beside the tools venv, lint and build):
  lint      yamllint --strict, ansible-lint (production profile), ruff, shellcheck
  sanity    ansible-test sanity on the collection's plugins
  build     the collection artifact built and installed; ansible-doc of every module, filter and role;
            every playbook's --syntax-check against both inventories
  unit      pytest tests/unit (pytest-xdist, both cores)
  driver    molecule test -s nvidia_driver (the NVIDIA driver role in Debian and Ubuntu containers)
  gateway   tests/gateway/run.sh (the front's fallback semantics on real nginx + njs)
  molecule  molecule -s default's test sequence, a step at a time: real vLLM, NIXL, vllm-router, nginx in four
            containers
--skip also takes molecule/default/tests file names for the molecule stage:$(verify_files)
EOF
}

main() {
  local only="${INFEROPS_TEST_STAGES:-}" skip="" stages="" s
  while [ $# -gt 0 ]; do
    case "$1" in
      --only) only="${2//,/ }"; shift 2 ;;
      --only=*) only="${1#--only=}"; only="${only//,/ }"; shift ;;
      --skip) skip="$skip ${2//,/ }"; shift 2 ;;
      --skip=*) s="${1#--skip=}"; skip="$skip ${s//,/ }"; shift ;;
      --list|-h|--help) usage; return 0 ;;
      *) usage >&2; die "unknown argument: $1" ;;
    esac
  done
  local verify_files
  verify_files="$(verify_files)"
  for s in $only; do [[ " $ALL_STAGES " == *" $s "* ]] || die "unknown stage '$s' (stages: $ALL_STAGES)"; done
  local verify_skip=""
  for s in $skip; do
    if [[ " $ALL_STAGES " == *" $s "* ]]; then :
    elif [[ "$verify_files " == *" $s "* ]]; then verify_skip="$verify_skip $s"
    else die "unknown stage or molecule test file '$s' (stages: $ALL_STAGES; files:$verify_files)"; fi
  done
  for s in $ALL_STAGES; do
    if { [ -z "$only" ] || [[ " $only " == *" $s "* ]]; } && [[ " $skip " != *" $s "* ]]; then stages="$stages $s"; fi
  done
  stages="${stages# }"
  has() { [[ " $stages " == *" $1 "* ]]; }

  local start bin t0 times=()
  start=$(date +%s)
  stage() { printf '\n\033[1m== %s\033[0m (t+%ss)\n' "$*" "$(( $(date +%s) - start ))"; }
  # busy: the jiffies this machine's cores have been busy (not idle, not waiting for I/O) since boot.
  busy() { awk '/^cpu /{print $2+$3+$4+$7+$8+$9; exit}' /proc/stat; }
  local hz cores
  hz=$(getconf CLK_TCK); cores=$(nproc)
  # timed NAME COMMAND...: runs a stage's command and records its time for the table at the end, with how busy
  # it kept the machine's cores (what is left is what another stage beside it could have used).
  timed() {
    local name="$1" t b rc=0; shift
    t=$(date +%s); b=$(busy)
    "$@" || rc=$?
    t=$(( $(date +%s) - t )); b=$(( $(busy) - b ))
    times+=("$name|$t|$rc|$(( t > 0 ? 100 * b / (hz * cores * t) : 0 ))")
    return "$rc"
  }

  stage "stages: $stages${verify_skip:+ (molecule verify without:$verify_skip)}"
  stage "sandbox and tools"
  t0=$(date +%s)
  "$REPO_ROOT/scripts/sandbox/setup.sh" host
  # The images, the wheelhouses and the model (minutes on a fresh machine, half of it downloads and one core's
  # work) are made in the background while the tools venv is built and lint, build and sanity run: none of
  # those reads them. The unit, driver, gateway and molecule stages start once they are there.
  local setup_dir setup_pid
  setup_dir="$(mktemp -d)"
  # Two chains at once, which share nothing: the images (debootstrap and dpkg, the mirror's speed) and the
  # downloads (the wheelhouses from PyPI, then the model converted with them). One after the other they took 252 s
  # of a fresh run, 132 s of it with the foreground waiting.
  ( t=$(date +%s); r=0; ri=0
    { "$REPO_ROOT/scripts/sandbox/setup.sh" image &&
      if has driver; then "$REPO_ROOT/scripts/sandbox/setup.sh" ubuntu-image; fi; } >"$setup_dir/images.log" 2>&1 &
    images=$!
    { "$REPO_ROOT/scripts/sandbox/setup.sh" wheelhouse && "$REPO_ROOT/scripts/sandbox/setup.sh" model; } \
      >"$setup_dir/log" 2>&1 || r=$?
    wait "$images" || ri=$?
    cat "$setup_dir/images.log" >>"$setup_dir/log"
    [ "$r" -ne 0 ] || r=$ri
    echo "setup: images, wheelhouses, model (beside tools, lint, build)|$(( $(date +%s) - t ))|$r" >"$setup_dir/time"
    exit $r ) &
  setup_pid=$!
  bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
  times+=("setup: host packages and the tools venv|$(( $(date +%s) - t0 ))|0")
  export PATH="$bin:$PATH"
  export_sandbox_env
  export ANSIBLE_FORCE_COLOR=0 PY_COLORS=0
  cd "$REPO_ROOT"
  # molecule installs a copy of the collection under test into ~/.ansible/collections; a stale
  # one from an earlier run would shadow this checkout for ansible-lint.
  rm -rf "$HOME/.ansible/collections/ansible_collections/inferops/vllm"
  # Every playbook a molecule test runs leaves its output here (molecule/default/tests/conftest.py).
  export INFEROPS_TEST_LOG_DIR
  INFEROPS_TEST_LOG_DIR="$(mktemp -d /tmp/inferops-test-logs.XXXXXX)"

  # Background stages: ansible-test sanity (one core most of its time) runs beside lint, build and the unit
  # stage; the driver scenario (apt and podman exec, little CPU) and the gateway checks (one nginx container),
  # which need the images, beside the unit stage. Each writes a log shown when they have all ended, and all end
  # before the default scenario creates its network (two networks created at once could pick the same bridge).
  local bg_dir bg_pids=()
  bg_dir="$(mktemp -d)"
  background() {  # background NAME COMMAND...: run it, keep its output, its time and its exit status
    local name="$1"; shift
    # (set -e is on: the exit status is taken with || so that a failure still writes its row)
    ( t=$(date +%s); r=0; "$@" >"$bg_dir/$name.log" 2>&1 || r=$?
      echo "$name (in the background)|$(( $(date +%s) - t ))|$r" >"$bg_dir/$name.time"; exit $r ) &
    bg_pids+=($!)
    stage "started in the background: $name"
  }
  if has sanity; then background sanity "$REPO_ROOT/scripts/sanity.sh"; fi

  local fg_rc=0
  if has lint; then
    stage "lint: yamllint, ansible-lint (production profile), ruff, shellcheck"
    timed lint lint_all || fg_rc=1
  fi
  if has build && [ "$fg_rc" -eq 0 ]; then
    stage "collection: build and install the artifact, docs render, playbooks and inventories parse"
    timed build build_all || fg_rc=1
  fi
  stage "waiting for the sandbox images, wheelhouses and model (made in the background)"
  local setup_rc=0
  wait "$setup_pid" || setup_rc=$?
  cat "$setup_dir/log"
  times+=("$(cat "$setup_dir/time")")
  rm -rf "$setup_dir"
  if [ "$setup_rc" -ne 0 ]; then
    wait "${bg_pids[@]}" 2>/dev/null || true
    report_times
    echo "failed: the sandbox setup (its output is above)" >&2
    return 1
  fi
  if has driver; then background driver molecule test -s nvidia_driver; fi
  if has gateway; then background gateway bash tests/gateway/run.sh; fi
  if has unit && [ "$fg_rc" -eq 0 ]; then
    stage "unit tests (pytest-xdist, 2 workers)"
    timed unit pytest -q -n 2 --dist loadfile --durations=15 tests/unit || fg_rc=1
  fi
  local bg_rc=0 pid name
  if [ ${#bg_pids[@]} -gt 0 ]; then
    t0=$(date +%s)
    for pid in "${bg_pids[@]}"; do wait "$pid" || bg_rc=1; done
    times+=("(waiting for the background stages)|$(( $(date +%s) - t0 ))|0")
    for name in sanity driver gateway; do
      [ -f "$bg_dir/$name.log" ] || continue
      stage "$name (ran in the background): its output"
      cat "$bg_dir/$name.log"
      [ -f "$bg_dir/$name.time" ] && times+=("$(cat "$bg_dir/$name.time")")
    done
  fi
  rm -rf "$bg_dir"
  if [ "$fg_rc" -ne 0 ] || [ "$bg_rc" -ne 0 ]; then
    report_times
    echo "failed: see the FAILED rows above (a background stage's output is shown above its row)" >&2
    return 1
  fi

  if has molecule; then
    # molecule/default/prepare.yml starts a package index (the decode host installs from it).
    trap '"$REPO_ROOT/scripts/sandbox/index_server.sh" stop >/dev/null 2>&1 || true' EXIT
    # molecule test's sequence (molecule.yml's test_sequence), step by step: a row per step in the time table.
    # (`molecule create` runs prepare.yml itself: a `molecule prepare` step after it only said "already prepared".)
    local mol_rc=0 step
    for step in destroy create converge idempotence verify; do
      stage "molecule $step -s default${verify_skip:+ (verify without:$verify_skip)}"
      [ "$step" != destroy ] || kill_scenario_containers default
      INFEROPS_VERIFY_SKIP="${verify_skip# }" timed "molecule: $step" molecule "$step" -s default || { mol_rc=1; break; }
    done
    stage "molecule destroy -s default"
    kill_scenario_containers default
    timed "molecule: destroy" molecule destroy -s default || mol_rc=1
    playbook_recaps
    if [ "$mol_rc" -ne 0 ]; then report_times; return 1; fi
  fi

  report_times
  stage "all stages passed: $stages"
}

# The containers of a molecule scenario killed at once (SIGKILL): molecule's destroy stops them with podman's
# 10 s grace each, in which systemd in each container stops vLLM, nginx and Prometheus one by one (40 s of the
# last destroy). Nothing in them is kept; molecule destroy then removes the rest (its network, its state).
kill_scenario_containers() {
  local names
  names="$(python3 -c 'import sys, yaml
print(" ".join(p["name"] for p in yaml.safe_load(open(sys.argv[1]))["platforms"]))' \
    "$REPO_ROOT/molecule/$1/molecule.yml")"
  # shellcheck disable=SC2086  # one word per container
  podman rm --force --time 0 --ignore $names >/dev/null
}

# shellcheck disable=SC2317  # called through timed
lint_all() {
  yamllint --strict . && ansible-lint --offline && ruff check . &&
    shellcheck -x scripts/*.sh scripts/sandbox/*.sh tests/gateway/*.sh .ci/run
}

# shellcheck disable=SC2317  # called through timed
build_all() {
  local out module filter role inv
  out="$(mktemp -d)"
  ansible-galaxy collection build --force --output-path "$out" . >/dev/null || return 1
  ANSIBLE_COLLECTIONS_PATH="$out/installed" ansible-galaxy collection install --force --offline --no-deps \
    -p "$out/installed" "$out"/inferops-vllm-*.tar.gz >/dev/null || return 1
  test -f "$out/installed/ansible_collections/inferops/vllm/roles/vllm_instance/files/inferops_vllm_launch.py" || return 1
  test ! -e "$out/installed/ansible_collections/inferops/vllm/molecule" || return 1
  rm -rf "$out"
  # Every module, filter (each documented by its .yml) and role there is: none can be forgotten.
  for module in plugins/modules/*.py; do
    ansible-doc -t module "inferops.vllm.$(basename "$module" .py)" >/dev/null || return 1
  done
  for filter in plugins/filter/*.yml; do
    ansible-doc -t filter "inferops.vllm.$(basename "$filter" .yml)" >/dev/null || return 1
  done
  for role in roles/*/; do
    ansible-doc -t role "inferops.vllm.$(basename "$role")" >/dev/null || return 1
  done
  for inv in sandbox example; do
    ansible-inventory -i "inventories/$inv" --list >/dev/null || return 1
    ansible-playbook --syntax-check -i "inventories/$inv" playbooks/*.yml >/dev/null || return 1
  done
}

# Every playbook that a molecule test ran: its command, result, wall time and its slowest tasks
# (ansible.posix.profile_tasks' recap), passing or not.
playbook_recaps() {
  local log
  [ -d "${INFEROPS_TEST_LOG_DIR:-}" ] || return 0
  stage "playbooks run by the molecule tests: time and slowest tasks"
  for log in "$INFEROPS_TEST_LOG_DIR"/*.log; do
    [ -f "$log" ] || continue
    head -n 1 "$log"
    grep -E -- ' -{3,} +[0-9]+\.[0-9]+s$' "$log" | head -n 8 | sed 's/^/    /'
  done
}

# The table of each stage's time, at the end of every run (passing or not).
report_times() {
  local row name secs rc total=$(( $(date +%s) - start ))
  printf '\n\033[1m== time per stage\033[0m\n'
  printf '%-62s %8s %6s  %s\n' "stage" "seconds" "busy" "result"
  for row in "${times[@]}"; do
    IFS='|' read -r name secs rc pct <<<"$row"
    printf '%-62s %8s %6s  %s\n' "$name" "$secs" "${pct:+$pct %}" "$([ "$rc" = 0 ] && echo ok || echo "FAILED ($rc)")"
  done
  printf '%-62s %8s  (%dm %02ds)\n' "total (wall clock)" "$total" $(( total / 60 )) $(( total % 60 ))
}

main "$@"
exit $?
