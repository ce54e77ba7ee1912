"""docs/operations.md's "Reading `adloader status` and the metrics" names only fields the agent's status
document has and metrics it exports, and names every metric: a real agent (cgroup mode off, its socket
in tmp_path) with one job that said hello makes the document, and the metrics exporter renders it
without serving it."""
from __future__ import annotations

import os
import re

import pytest

from adloader import protocol
from agent import config as configmod
from tests.conftest import REPO

pytestmark = pytest.mark.component

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
OPERATIONS = REPO / "docs" / "operations.md"
FILES_NAMED_AGENT = {"toml", "log"}      # `agent.toml`, `agent.log`: files, not status fields


@pytest.fixture(scope="module")
def status(tmp_path_factory) -> dict:
    from agent.daemon import Agent
    from agent.security import Peer

    d = tmp_path_factory.mktemp("agent")
    cfg = configmod.load(None, {"endpoint": f"ipc://{d}/agent.sock", "state_dir": str(d / "state"),
                                "cgroup_mode": "off"}, environ={})
    agent = Agent(cfg)
    try:
        me = os.getpid()
        agent.registry.hello(Peer(os.getuid(), os.getgid(), me), b"a",
                             protocol.make("hello", job="j1", rank=0, pid=me, uid=os.getuid(), workers=0,
                                           worker_pids=[]), 0.0)
        agent.tick(1.0)
        return agent.status_doc()
    finally:
        agent.server.close()
        agent.ctx.term()


def _section(title: str) -> str:
    text = OPERATIONS.read_text()
    start = text.index(title)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def test_every_job_field_the_status_table_explains_is_in_a_jobs_row(status):
    assert status["jobs"], "the agent listed no job"
    row = status["jobs"][0]
    named = set()
    for line in _section("## Reading `adloader status`").splitlines():
        cells = line.split("|")
        if line.startswith("| `") and len(cells) > 2:
            named |= set(re.findall(r"`(\w+)`", cells[1]))
    assert {"workers", "reason", "apply_ok"} <= named, "the status field table was not found"
    assert not named - set(row), f"fields the status table explains that a job's row lacks: {sorted(named - set(row))}"


def test_every_agent_and_node_field_the_docs_name_is_in_the_status_document(status):
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        for part in ("agent", "node"):
            for name in sorted(set(re.findall(rf"`{part}\.(\w+)`", text))):
                if part == "agent" and name in FILES_NAMED_AGENT:
                    continue
                if name not in (status.get(part) or {}):
                    stale.append(f"{part}.{name} ({doc.name})")
    assert not stale, f"the docs name status fields the agent's status document does not have: {stale}"


def exported_metrics(status: dict) -> set[str]:
    from prometheus_client import generate_latest

    from agent.metrics import JOB_GAUGES, Metrics

    doc = {**status, "jobs": [{**status["jobs"][0], **{k: 1.0 for k in JOB_GAUGES}}]}   # every per-job gauge set
    metrics = Metrics(0)
    metrics.update(doc, counts={"report": 1}, errors={"malformed": 1})
    body = generate_latest(metrics.registry).decode()
    return {re.split(r"[{ ]", line)[0].removesuffix("_created") for line in body.splitlines()
            if line and not line.startswith("#")}


def test_the_metrics_the_docs_list_are_the_ones_exported(status):
    exported = exported_metrics(status)
    section = _section("## Reading `adloader status`")
    listed = set(re.findall(r"`(adloader_\w+)", section[section.index("Prometheus metrics"):]))
    assert not listed - exported, f"metrics the docs list that the agent does not export: {sorted(listed - exported)}"
    assert not exported - listed, f"metrics the agent exports that the docs do not list: {sorted(exported - listed)}"
