"""agent/daemon.py, the composition root: what it builds and what it lets a caller inject (the end-to-end
runs of the daemon are in test_agent_component.py)."""
from __future__ import annotations

import pytest

from agent import config as configmod
from agent.model import AllocationPlan

pytestmark = pytest.mark.component


def test_an_injected_policy_decides_and_no_global_registry_changes(tmp_path):
    """The bench's oracle is handed to the Agent like a predictor; agent.policies.POLICIES is not edited."""
    from agent.daemon import Agent
    from agent.policies import POLICIES

    before = dict(POLICIES)
    seen = []

    def oracle(snapshot, curves, config):
        seen.append(snapshot)
        return AllocationPlan(policy="oracle", allocations={})

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg, policy=oracle)
    try:
        agent.controller.tick(1.0)
        assert len(seen) == 1 and seen[0].applied == {}
        assert agent.policy_name == "oracle" and agent.status_doc()["agent"]["policy"] == "oracle"
        agent.controller = agent._build_controller()           # what a SIGHUP reload does: still injected
        agent.controller.tick(2.0)
        assert len(seen) == 2
        assert POLICIES == before
    finally:
        agent.server.close()
        agent.ctx.term()


def test_each_switch_of_the_loaders_yield_is_logged_with_its_reason(tmp_path, caplog):
    """An operator sees when and why the loaders stopped yielding to the trainers (not every tick)."""
    import logging

    from agent.daemon import Agent
    from agent.model import NodeAllocation

    states = iter([True, True, False, False, True])

    def policy(snapshot, curves, config):
        on = next(states)
        return AllocationPlan(policy="t", allocations={}, node=NodeAllocation(on, {}, f"reason {on}"))

    cfg = configmod.load(None, {"endpoint": f"ipc://{tmp_path}/agent.sock", "state_dir": str(tmp_path / "state"),
                                "cgroup_mode": "off", "policy": "even"}, environ={})
    agent = Agent(cfg, policy=policy)
    try:
        with caplog.at_level(logging.INFO, logger="agent.daemon"):
            for t in range(5):
                agent.tick(float(t + 1))
        got = [(r.fields["on"], r.fields["reason"]) for r in caplog.records if getattr(r, "event", "") == "loaders_yield"]
        assert got == [(True, "reason True"), (False, "reason False"), (True, "reason True")]
    finally:
        agent.server.close()
        agent.ctx.term()
