#!/usr/bin/env bash
# Checks roles/nvidia_driver's package names and cuda-keyring hashes against NVIDIA's CUDA repository
# and Debian's contrib/non-free `Packages` indexes (scripts/check_nvidia_repo.py says how), with the
# tools venv's Python. Exit status 0: all found; 1: a mismatch; 3: a repository could not be reached.
# Arguments go to the Python script (--repo-url, --branch, --only cuda_repo|distribution, --timeout).
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"
bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
exec "$bin/python" "$REPO_ROOT/scripts/check_nvidia_repo.py" "$@"
