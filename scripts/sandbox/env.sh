# shellcheck shell=bash
# Source it (bash) to run the playbooks by hand against the sandbox of up.sh, from the checkout:
#   source scripts/sandbox/env.sh
#   ansible-playbook playbooks/verify.yml -i inventories/sandbox
# It puts the tools venv (the pinned ansible-core, molecule, the linters; scripts/sandbox/tools.sh builds it once)
# on PATH. Nothing else is needed: ansible.cfg finds the collections, and inventories/sandbox reads its paths and
# keys from the cache directory itself (group_vars/all/sandbox.yml; INFEROPS_CACHE_DIR when the cache is elsewhere).
# It sets no shell option, so it is safe in an interactive shell.
__inferops_tools_bin="$(bash "$(dirname "${BASH_SOURCE[0]}")/tools.sh")" &&
  case ":$PATH:" in
    *":$__inferops_tools_bin:"*) ;;
    *) export PATH="$__inferops_tools_bin:$PATH" ;;
  esac
unset __inferops_tools_bin
