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



def test_the_exposition_parses_with_counters_typed_as_counters_and_odd_label_values_escaped():
    """Before: adloader_ticks_total, adloader_pids_skipped_total, adloader_messages_total and
    adloader_errors_total were gauges (``# TYPE adloader_ticks_total gauge``): a ``_total`` name that is not
    a counter, which promtool's lint refuses and rate() dashboards treat as a gauge. Now they are counters,
    under the same sample names; every family has one HELP and one TYPE, no series is repeated, and a
    label value holding a quote, a backslash or a newline comes back from the parser as it was sent."""
    pytest.importorskip("prometheus_client")
    from prometheus_client import generate_latest
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.openmetrics.parser import text_string_to_metric_families as parse_openmetrics
    from prometheus_client.parser import text_string_to_metric_families

    from agent.metrics import Metrics

    m = Metrics(0)
    odd = ['a"b', "c\\d", "e\nf", "ü"]
    doc = status_doc()
    doc["agent"].update(ticks=9, pids_skipped=2)
    doc["jobs"] = [dict(doc["jobs"][0], job=j) for j in ["j1", *odd]]
    m.update(doc, {"report": 7, "hello": 2}, {"malformed": 2})
    m.update(doc, {"report": 8, "hello": 2}, {"malformed": 2})       # a second tick: values, not new series
    text = generate_latest(m.registry).decode()
    for name in ("adloader_ticks_total", "adloader_pids_skipped_total", "adloader_messages_total",
                 "adloader_errors_total"):
        assert text.count(f"# TYPE {name} counter\n") == 1 and text.count(f"# HELP {name} ") == 1, text
    assert "adloader_ticks_total 9.0" in text and 'adloader_messages_total{type="report"} 8.0' in text
    families = list(text_string_to_metric_families(text))
    types = {f.name: f.type for f in families}
    assert types["adloader_ticks"] == types["adloader_messages"] == "counter"
    assert types["adloader_jobs"] == types["adloader_job_workers"] == "gauge"
    assert len(types) == len(families)                                  # one family per name
    series = [(s.name, tuple(sorted(s.labels.items()))) for f in families for s in f.samples]
    assert len(series) == len(set(series)), series
    workers = {s.labels["job"]: s.value for f in families if f.name == "adloader_job_workers" for s in f.samples}
    assert workers == {j: 2.0 for j in ["j1", *odd]}
    om = {f.name: f.type for f in parse_openmetrics(openmetrics_latest(m.registry).decode())}   # (raises if invalid)
    assert om["adloader_ticks"] == "counter" and om["adloader_jobs"] == "gauge"
