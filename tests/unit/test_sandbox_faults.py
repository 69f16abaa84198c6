# Copyright (c) inferops.vllm developers
# GNU General Public License v3.0+ (see LICENSES/GPL-3.0-or-later.txt or https://www.gnu.org/licenses/gpl-3.0.txt)
# SPDX-License-Identifier: GPL-3.0-or-later
"""benchmarks/sandbox_faults.py, the faults benchmarks/chaos.py and the molecule tests put into the containers: the
nftables rules parse (`nft --check`, as on the prefill host), each in its own table, and the kill command is valid
shell. The faults themselves run in molecule (test_day2.py) and in chaos.py."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from sandbox_faults import kill_vllm_command, peer_block_rules  # noqa: E402  (benchmarks/ is no package)


@pytest.mark.parametrize("action", ["drop", "reject"])
def test_the_peer_block_rules_parse_and_sit_in_their_own_table(action):
    rules = peer_block_rules("inferops_test_table", "10.89.0.12", action)
    assert rules.startswith("table inet inferops_test_table {\n") and rules.count("\ntable ") == 0, rules
    assert "ip saddr 10.89.0.12 " in rules
    # drop cuts both directions; reject answers the peer's TCP packets with a reset (and so must not drop ours)
    assert ("ip daddr 10.89.0.12 drop" in rules) == (action == "drop"), rules
    assert ("reject with tcp reset" in rules) == (action == "reject"), rules
    assert shutil.which("nft"), "nft is not installed: apt-get install nftables (scripts/sandbox/setup.sh does)"
    check = subprocess.run(["nft", "--check", "--file", "-"], input=rules, capture_output=True, text=True, check=False)
    assert check.returncode == 0, f"{check.stderr}\n{rules}"


def test_an_unknown_action_is_refused():
    with pytest.raises(ValueError, match="drop"):
        peer_block_rules("t", "10.89.0.12", "accept")


def test_the_kill_command_is_shell_and_names_each_unit():
    command = kill_vllm_command(["vllm@decode-0.service", "vllm@decode-1.service"])
    assert subprocess.run(["sh", "-n", "-c", command], check=False).returncode == 0, command
    for unit in ("vllm@decode-0.service", "vllm@decode-1.service"):
        assert f"systemctl show -p MainPID --value {unit}" in command
    assert command.count("kill -9") == 2
