"""the transformers Trainer: `adloader.integrations.transformers.Trainer`, with the real framework on CPU (1 process, and 2 over gloo with a live agent). The
framework tier: `-m frameworks` selects it; it skips with the reason where the framework is absent
(`./run setup` installs the [frameworks] extra). What each run checks: tests/integration_train.py.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.integration_train import one_process, two_processes_with_agent

pytestmark = [pytest.mark.component, pytest.mark.frameworks,
              pytest.mark.skipif(importlib.util.find_spec("transformers") is None,
                                 reason="transformers is not installed (pip install -e '.[frameworks]' -c constraints-frameworks.txt)")]

RUNS = {"trainer": 2, "auto": 1}


def test_one_process(tmp_path):
    results = one_process("transformers", RUNS, str(tmp_path))
    for run in ("trainer", "auto"):      # trainer.evaluate() ran on an A-Dloader loader as well
        ev = results[0]["runs"][run]["eval"]
        assert ev["is_adloader"] and ev["steps"] == 192 // 4 and ev["workers"] >= 1, ev
        # the Trainer told the train loader its length: steps_left counts down to 0, withdrawn at the end
        r = results[0]["runs"][run]
        left, total = r["steps_left"], r["max_steps"]
        assert len(left) == total and total == (192 // 4) * (2 if run == "trainer" else 1), (run, total)
        assert all(v is not None and total - i - 2 <= v <= total - i for i, v in enumerate(left)), left
        assert r["steps_left_after"] is None
    assert all(v is None for v in results[0]["runs"]["torch"]["steps_left"])


def test_two_processes_gloo_with_a_live_agent(base, tmp_path):
    two_processes_with_agent("transformers", RUNS, base, str(tmp_path))
