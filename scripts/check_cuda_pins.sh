#!/usr/bin/env bash
# Resolves vllm_install's `cuda` variant as pip would on each supported host OS and architecture, against
# the real index, reading wheel metadata only (scripts/check_cuda_pins.py says how), with the tools venv's
# Python. Needs the network; a few minutes for the whole matrix. Exit status 0: coherent; 1: a pin does
# not exist or does not resolve, or torch and NIXL disagree on CUDA; 2: the index cannot be reached.
# Arguments go to the Python script (--os, --arch, --index-url, --extra-index-url, --jobs).
# shellcheck source=scripts/sandbox/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/sandbox/lib.sh"
bin="$("$REPO_ROOT/scripts/sandbox/tools.sh")"
exec "$bin/python" "$REPO_ROOT/scripts/check_cuda_pins.py" "$@"
