"""Prometheus metrics on 127.0.0.1:<metrics_port> (0 = off), through ``prometheus_client``.

Gauges per job (label ``job``) refreshed from the status document once per tick; a departed job's
series are removed. Names:

    adloader_jobs                               jobs on the node
    adloader_loader_cpus                        CPU cores the node gives to loaders (the budget in force: an
                                                "auto" budget grown into the reserve the trainers leave)
    adloader_tick_seconds                       duration of the last tick
    adloader_ticks_total                        ticks run
    adloader_pids_skipped_total                 worker pids not moved or pinned: no longer the reported worker
    adloader_job_workers{job}                   loader workers (reported)
    adloader_job_cpus{job}                      CPU cores in force (absent before the first apply)
    adloader_job_data_wait_fraction{job}        0..1
    adloader_job_gpu_idle_fraction{job}         0..1
    adloader_job_samples_per_second{job}
    adloader_job_max_useful_workers{job}
    adloader_job_supply_cap_samples_per_second{job}  (absent unless the predictor saw one: ``predictor.bank``)
    adloader_messages_total{type}, adloader_errors_total{code}  (from the server's counts)

The ``_total`` ones are counters (``# TYPE ... counter``: they only grow, and start again from 0 with a
new agent process, which ``rate()`` takes as a counter reset), the rest gauges. They are counts the
agent keeps itself, so they are exposed by a collector that reads the last values ``update`` was given
(``_Totals``) rather than by prometheus_client's ``Counter``, which can only be incremented.
"""
from __future__ import annotations

from typing import Optional

JOB_GAUGES = {
    "workers": ("adloader_job_workers", "loader workers (reported by the job's clients)"),
    "cpus": ("adloader_job_cpus", "CPU cores in force for the job's loader workers"),
    "data_wait_frac": ("adloader_job_data_wait_fraction", "share of step time blocked on data"),
    "gpu_idle_frac": ("adloader_job_gpu_idle_fraction", "share of time the job's GPUs were idle"),
    "samples_per_s": ("adloader_job_samples_per_second", "samples per second, all ranks"),
    "max_useful_workers": ("adloader_job_max_useful_workers", "predicted max useful loader workers"),
    "supply_cap_samples_per_s": ("adloader_job_supply_cap_samples_per_second",
                                 "samples/s the job's data source gave at most, however many workers read it"),
}


# counter -> (help, label name or None); exposed as <name>_total
TOTALS = {
    "adloader_ticks": ("ticks run", None),
    "adloader_pids_skipped": ("worker pids not moved or pinned: the pid was no longer the reported worker", None),
    "adloader_messages": ("messages received by type", "type"),
    "adloader_errors": ("error replies by code", "code"),
}


class _Totals:
    """A prometheus_client collector of the counters in ``TOTALS``, at the values last ``set``."""

    def __init__(self) -> None:
        self.values: dict[str, object] = {name: ({} if label else 0.0) for name, (_, label) in TOTALS.items()}

    def set(self, name: str, value) -> None:
        self.values[name] = dict(value) if isinstance(value, dict) else float(value)   # (a copy: read by the scrape)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        for name, (help_, label) in TOTALS.items():
            value = self.values[name]
            if label is None:
                yield CounterMetricFamily(name, help_, value=value)
                continue
            family = CounterMetricFamily(name, help_, labels=[label])
            for key, n in sorted(value.items()):
                family.add_metric([str(key)], float(n))
            yield family


class Metrics:
    def __init__(self, port: int, addr: str = "127.0.0.1"):
        from prometheus_client import CollectorRegistry, Gauge

        self.port = port
        self.addr = addr
        self.registry = CollectorRegistry()
        self._server = None
        self.jobs = Gauge("adloader_jobs", "jobs on the node", registry=self.registry)
        self.loader_cpus = Gauge("adloader_loader_cpus", "CPU cores for loaders, all jobs", registry=self.registry)
        self.tick_s = Gauge("adloader_tick_seconds", "duration of the last tick", registry=self.registry)
        self.totals = _Totals()
        self.registry.register(self.totals)
        self.per_job = {k: Gauge(name, help_, ["job"], registry=self.registry) for k, (name, help_) in JOB_GAUGES.items()}
        self._known: set[str] = set()

    def start(self) -> None:
        from prometheus_client import start_http_server

        got = start_http_server(self.port, addr=self.addr, registry=self.registry)
        self._server = got[0] if isinstance(got, tuple) else None

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def update(self, doc: dict, counts: Optional[dict] = None, errors: Optional[dict] = None) -> None:
        a = doc.get("agent", {})
        self.jobs.set(len(doc.get("jobs", [])))
        self.loader_cpus.set(a.get("loader_cpus_in_force") or a.get("loader_cpus") or 0)
        self.tick_s.set((a.get("last_tick_ms") or 0) / 1000.0)
        self.totals.set("adloader_ticks", a.get("ticks") or 0)
        self.totals.set("adloader_pids_skipped", a.get("pids_skipped") or 0)
        if counts is not None:
            self.totals.set("adloader_messages", counts)
        if errors is not None:
            self.totals.set("adloader_errors", errors)
        seen = set()
        for j in doc.get("jobs", []):
            job = j["job"]
            seen.add(job)
            for k, g in self.per_job.items():
                v = j.get(k)
                if v is None:
                    try:
                        g.remove(job)
                    except KeyError:
                        pass
                else:
                    g.labels(job=job).set(float(v))
        for job in self._known - seen:
            for g in self.per_job.values():
                try:
                    g.remove(job)
                except KeyError:
                    pass
        self._known = seen
