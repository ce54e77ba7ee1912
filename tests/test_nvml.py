"""agent/nvml.py with a fake pynvml: per-process and per-device idle, NotFound carries the last sample
forward, no driver retried with backoff."""
from __future__ import annotations

import pytest

from agent.nvml import GpuSampler
from tests.fakes import FakeNvml

pytestmark = pytest.mark.unit


def test_nvml_per_process_device_and_carry_forward():
    nv = FakeNvml()
    g = GpuSampler(nv)
    g.sample(0.0)
    assert g.available
    assert g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)          # its own SM use: 25%
    assert g.job_idle_frac(["GPU-1"], [111]) == pytest.approx(0.10)      # no per-process sample: device util
    g.sample(1.0)                                                        # NotFound: carry forward
    assert g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)
    assert g.job_idle_frac(["7"], [111]) is None                         # not a device here


def test_nvml_absent_retries_with_backoff_and_says_so_once():
    nv = FakeNvml(fail_init=True)
    g = GpuSampler(nv)
    for t in (0.0, 1.0, 2.0, 4.9):
        g.sample(t)
    assert nv.inits == 1 and not g.available and "Driver Not Loaded" in g.last_error
    g.sample(5.0)
    assert nv.inits == 2
    nv.fail_init = False
    g.sample(14.9)
    assert nv.inits == 2            # backoff doubled to 10 s
    g.sample(15.0)
    assert g.available and g.job_idle_frac(["1"], []) == pytest.approx(0.10)

