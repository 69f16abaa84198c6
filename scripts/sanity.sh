#!/usr/bin/env bash
# ansible-test sanity on a copy of this checkout laid out as ansible_collections/inferops/vllm
# (ansible-test insists on that path). Called by scripts/test.sh with the tools venv on PATH.
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"

# ansible-test bootstraps pip in its venvs with a script it downloads from
# ci-files.testing.ansible.com, which our machines cannot reach. This stand-in does the same job
# with the interpreter's own ensurepip and pip from PyPI.
bootstrap="$HOME/.ansible/test/cache/get_pip_24_2.py"
if [ ! -f "$bootstrap" ]; then
  mkdir -p "$(dirname "$bootstrap")"
  cat >"$bootstrap" <<'PY'
# Stand-in written by inferops.vllm's scripts/sanity.sh: ensurepip, then pip 24.2 from PyPI.
import subprocess
import sys

args = [a for a in sys.argv[1:] if not a.startswith("-")]
subprocess.check_call([sys.executable, "-m", "ensurepip", "--upgrade"])
subprocess.check_call([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "pip==24.2", *args])
PY
fi

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
dest="$work/ansible_collections/inferops/vllm"
mkdir -p "$dest"
cd "$REPO_ROOT"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$dest"
cd "$dest"
git init -q && git add -A
# pslint: no PowerShell here; changelog: needs antsibull-changelog, which we do not pin.
ansible-test sanity --python "$(python3 -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')" \
  --skip-test pslint --skip-test changelog "$@" 2> >(grep -v 'Using locale "C.UTF-8"\|Reviewing previous' >&2)
