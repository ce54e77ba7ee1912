"""agent/metrics.py: Prometheus exposition on a real localhost port."""
from __future__ import annotations

import urllib.request

import pytest

from evaluation.slurm_cluster import free_port
from tests.fakes import status_doc

pytestmark = pytest.mark.component


def test_metrics_exposed_on_localhost():
    pytest.importorskip("prometheus_client")
    from agent.metrics import Metrics

    port = free_port()
    m = Metrics(port)
    m.start()
    try:
        m.update(status_doc(), {"report": 7}, {"malformed": 2})
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'adloader_job_workers{job="j1"} 2.0' in body
        assert 'adloader_job_data_wait_fraction{job="j1"} 0.31' in body
        assert 'adloader_errors_total{code="malformed"} 2.0' in body
        assert "adloader_loader_cpus 1.8" in body
        assert "adloader_pids_skipped_total 0.0" in body                     # the field absent: none
        assert "adloader_job_supply_cap_samples_per_second{" not in body    # none seen: no series
        capped = status_doc()
        capped["jobs"][0]["supply_cap_samples_per_s"] = 320.0
        capped["agent"]["pids_skipped"] = 3
        m.update(capped)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'adloader_job_supply_cap_samples_per_second{job="j1"} 320.0' in body
        assert "adloader_pids_skipped_total 3.0" in body
        doc = status_doc()
        doc["jobs"] = []
        doc["agent"]["loader_cpus_in_force"] = 46.0      # an auto budget grown into the reserve
        m.update(doc)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        assert 'job="j1"' not in body and "adloader_jobs 0.0" in body
        assert "adloader_loader_cpus 46.0" in body
    finally:
        m.stop()

