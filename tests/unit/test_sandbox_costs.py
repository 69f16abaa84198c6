"""benchmarks/sandbox_costs.py: the CPU accounting of its no-op figures (the machine's busy core-seconds from
/proc/stat, and the floor they set on the wall time), on this machine's real /proc/stat and on a captured line."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sandbox_costs as sc  # noqa: E402  (benchmarks/ is no package)

# A 2-core machine's /proc/stat head (Linux 6.x: user nice system idle iowait irq softirq steal guest guest_nice).
STAT = """cpu  1000 20 300 5000 40 5 6 7 100 0
cpu0 500 10 150 2500 20 3 3 4 50 0
cpu1 500 10 150 2500 20 2 3 3 50 0
intr 12345
"""


def test_busy_counts_everything_but_idle_and_iowait():
    busy, total = sc.parse_machine_stat(STAT)
    assert busy == 1000 + 20 + 300 + 5 + 6 + 7  # guest time is inside user already
    assert total == busy + 5000 + 40


def test_a_short_cpu_line_of_an_old_kernel():
    assert sc.parse_machine_stat("cpu  10 0 5 100\n") == (15, 115)


def test_no_cpu_line_is_an_error():
    with pytest.raises(ValueError):
        sc.parse_machine_stat("intr 1\n")


def test_the_floor_is_the_busy_time_spread_over_the_cores():
    assert sc.cpu_floor(86.0, 2) == 43.0
    assert sc.cpu_floor(10.0, 0) == 10.0


@pytest.mark.skipif(not Path("/proc/stat").is_file(), reason="Linux only")
def test_a_busy_loop_shows_in_the_machines_busy_ticks():
    before = sc.parse_machine_stat(Path("/proc/stat").read_text())
    end = time.process_time() + 0.3
    while time.process_time() < end:
        pass
    after = sc.parse_machine_stat(Path("/proc/stat").read_text())
    busy = (after[0] - before[0]) / os.sysconf("SC_CLK_TCK")
    assert busy >= 0.2, busy
    assert after[1] > before[1]
