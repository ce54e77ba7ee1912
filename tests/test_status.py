"""agent/status.py: the `adloader status` table."""
from __future__ import annotations

import pytest

from tests.fakes import status_doc

pytestmark = pytest.mark.unit


def test_status_table_names_every_column():
    from agent.status import render_table

    t = render_table(status_doc())
    for word in ("JOB", "RANKS", "WORKERS", "CPUS", "WAIT", "GPU-IDLE", "SAMPLES/S", "MAX-USEFUL", "REASON",
                 "j1", "2->3", "31%", "marginal gain 0.2/core", "estimated from the job's data wait"):
        assert word in t, word

