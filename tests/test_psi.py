"""agent/psi.py: pressure stall information and the node's busy CPU time parsed from a file tree."""
from __future__ import annotations

import os

import pytest

from agent import psi

pytestmark = pytest.mark.unit


def test_psi_parsing(tmp_path):
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "cpu").write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=1\n"
                                               "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    p = psi.read(str(tmp_path))
    assert p.cpu_some_avg10 == 12.5 and p.io_some_avg10 is None



def test_busy_cpu_seconds_of_the_given_cpus(tmp_path):
    """user + nice + system + irq + softirq + steal of each listed cpuN, in USER_HZ ticks; idle and iowait
    are not busy; the aggregate 'cpu ' line and other CPUs are ignored."""
    (tmp_path / "stat").write_text(
        "cpu  999 999 999 999 999 999 999 999 0 0\n"
        "cpu0 10 1 2 500 7 3 4 5 0 0\n"        # busy 10+1+2+3+4+5 = 25 ticks
        "cpu1 20 0 0 500 0 0 0 0 0 0\n"        # 20
        "cpu2 1000 0 0 0 0 0 0 0 0 0\n"        # not asked for
        "intr 1 2 3\n")
    hz = os.sysconf("SC_CLK_TCK")
    assert psi.busy_cpu_s(str(tmp_path), (0, 1)) == pytest.approx(45 / hz)
    assert psi.busy_cpu_s(str(tmp_path), (7,)) is None                  # none of them listed
    assert psi.busy_cpu_s(str(tmp_path / "nowhere"), (0,)) is None
