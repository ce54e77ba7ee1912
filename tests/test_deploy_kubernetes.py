"""deploy/kubernetes/daemonset.yaml parses and gives the agent (and the example training pod) what the
design says they need. Needs PyYAML (the `dev` extra); skipped with the reason otherwise."""
from __future__ import annotations

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.unit

KUBE = REPO / "deploy" / "kubernetes"


def _load(name: str) -> list[dict]:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed: cannot parse the Kubernetes manifests")
    return [d for d in yaml.safe_load_all((KUBE / name).read_text()) if d]


@pytest.fixture(scope="module")
def docs() -> dict[str, dict]:
    agent, example = _load("daemonset.yaml"), _load("example-training-pod.yaml")
    assert [d["kind"] for d in agent] == ["Namespace", "ConfigMap", "DaemonSet"]
    assert [d["kind"] for d in example] == ["Pod"]
    return {d["kind"]: d for d in agent + example}


def test_manifests_hold_the_expected_objects(docs):
    assert docs["DaemonSet"]["apiVersion"] == "apps/v1"
    assert docs["ConfigMap"]["metadata"]["namespace"] == docs["DaemonSet"]["metadata"]["namespace"]


def _mounts(pod_spec: dict) -> dict[str, str]:
    """mountPath -> host path, for every hostPath volume mounted into the first container."""
    host = {v["name"]: v["hostPath"]["path"] for v in pod_spec["volumes"] if "hostPath" in v}
    return {m["mountPath"]: host[m["name"]] for m in pod_spec["containers"][0]["volumeMounts"] if m["name"] in host}


def test_agent_gets_host_cgroups_proc_socket_dir_and_journal(docs):
    ds = docs["DaemonSet"]
    spec = ds["spec"]["template"]["spec"]
    assert ds["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    assert spec["hostPID"] is True
    assert _mounts(spec) == {
        "/sys/fs/cgroup": "/sys/fs/cgroup",
        "/run/adloader": "/run/adloader",
        "/var/lib/adloader": "/var/lib/adloader",
    }
    container = spec["containers"][0]
    assert container["command"][:2] == ["adloader", "agent"]
    cgroup_mount = next(m for m in container["volumeMounts"] if m["mountPath"] == "/sys/fs/cgroup")
    cooperative = 'cgroup_mode = "cooperative"' in docs["ConfigMap"]["data"]["agent.toml"]
    assert cgroup_mount.get("readOnly", False) is cooperative  # writable exactly when the agent writes cgroups
    sc = container["securityContext"]
    assert sc.get("privileged") is not True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"]["drop"] == ["ALL"]
    assert set(sc["capabilities"]["add"]) == {"SYS_NICE", "SYS_PTRACE", "DAC_READ_SEARCH"}


def test_agent_config_map_uses_known_keys(docs):
    try:
        import tomllib
    except ImportError:  # Python 3.10
        import tomli as tomllib
    values = tomllib.loads(docs["ConfigMap"]["data"]["agent.toml"])
    assert values["cgroup_mode"] == "cooperative"
    config = pytest.importorskip("agent.config", reason="agent/config.py (agentd) is not in this build yet")
    assert set(values) <= set(config.KEYS)


def test_training_pod_reaches_the_socket(docs):
    spec = docs["Pod"]["spec"]
    assert _mounts(spec) == {"/run/adloader": "/run/adloader"}
    env = {e["name"]: e for e in spec["containers"][0]["env"]}
    assert env["ADLOADER_ENDPOINT"]["value"] == "ipc:///run/adloader/agent.sock"
    assert "ADLOADER_JOB_ID" in env
    # no hostPID: the agent maps the pod's own pids to host pids (NSpid; tests/test_agent_pidns.py)
    assert "hostPID" not in spec
