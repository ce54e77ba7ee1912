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



def test_one_lost_gpu_costs_that_gpu_only():
    """NVMLError_GpuIsLost (an Xid 79) or NotSupported on one device's utilisation took NVML down for
    every GPU (available False, re-initialised, lost again at the next sample): the others keep their
    figures, the failing one has none (not stale ones) until it answers again, and then it is back."""
    nv = FakeNvml()
    g = GpuSampler(nv)
    g.sample(0.0)
    nv.fail_util[1] = nv.NVMLError_GpuIsLost("GPU is lost")
    g.sample(1.0)
    assert g.available and nv.inits == 1
    assert g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)
    assert g.job_idle_frac(["GPU-1"], [222]) is None                      # no figure, not the stale 0.10
    assert "GpuIsLost" in g.device_errors["1"]
    g.sample(2.0)
    assert g.available and g.job_idle_frac(["0"], [111]) == pytest.approx(0.75)
    del nv.fail_util[1]
    g.sample(3.0)
    assert g.job_idle_frac(["1"], [222]) == pytest.approx(0.10) and "1" not in g.device_errors
    nv.fail_util.update({0: nv.NVMLError("Unknown Error"), 1: nv.NVMLError("Unknown Error")})
    g.sample(4.0)                                                        # every device: NVML is lost
    assert not g.available and g.job_idle_frac(["0"], [111]) is None


def test_a_device_nvml_refuses_a_handle_for_is_left_out_at_init():
    """nvmlDeviceGetHandleByIndex failing for one device (lost, or another container's: NoPermission)
    failed the whole init, retried with backoff for ever: the other devices are sampled."""
    nv = FakeNvml()
    nv.fail_handle[0] = nv.NVMLError_NoPermission("Insufficient Permissions")
    g = GpuSampler(nv)
    g.sample(0.0)
    assert g.available
    assert g.job_idle_frac(["GPU-1"], []) == pytest.approx(0.10)
    assert g.job_idle_frac(["0"], [111]) is None and "NoPermission" in g.device_errors["0"]
