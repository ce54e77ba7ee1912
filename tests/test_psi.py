"""agent/psi.py: pressure stall information parsed from a file tree."""
from __future__ import annotations

import pytest

from agent import psi

pytestmark = pytest.mark.unit


def test_psi_parsing(tmp_path):
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "cpu").write_text("some avg10=12.50 avg60=3.00 avg300=1.00 total=1\n"
                                               "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    p = psi.read(str(tmp_path))
    assert p.cpu_some_avg10 == 12.5 and p.io_some_avg10 is None

