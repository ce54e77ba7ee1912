"""Slurm tier: the agent and the Slurm scripts under a real Slurm (Debian 12's slurm-wlm 22.05, munge).

One single-node cluster on loopback (``evaluation/slurm_cluster.py``), real ``sbatch`` jobs as uid 65534
running a training loop on ``adloader.DataLoader``, the agent as root on a **non-default endpoint** set
only in its config file (so every job that attaches proves the scripts followed it), the prolog and
epilog in the glob form beside other programs. What it checks (issue 13):

- a job is registered under its Slurm id, its rank attaches (endpoint and job id from the TaskProlog),
  the epilog releases it and no cgroup of it is left;
- the agent down, or hung (SIGSTOP): jobs complete, the node is not drained, prolog and epilog take
  under 5 s, the log line says "agent down" or "timeout" respectively;
- two concurrent jobs each get a share; an opted-out job (ADLOADER_DISABLE=1) costs its neighbour nothing;
- a release missed while the agent was hung is made up for (``unseen_job_timeout_s``);
- under ``task/cgroup`` with ConstrainCores=yes (cpuset only, mounted under the cluster's directory: the
  memory hierarchy is never touched), ``cooperative`` mode keeps the job's workers inside the job's CPUs
  and writes no cgroup.

Skipped with the reason where not root or where the packages are missing (``.ci/run`` installs them).
Every daemon is stopped by the fixtures' finalizers, also on failure.
"""
from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest

from agent import cgroupfs
from tests.agentd_support import AgentProc
from tests.cgroup_support import CPU, CPUSET, ROOT
from tests.conftest import wait_for
from evaluation.slurm_cluster import JOB_USER, Cluster, why_not

pytestmark = [pytest.mark.system, pytest.mark.skipif(bool(why_not()), reason=why_not() or "ok")]

BOUND_S = 5.0            # prolog/epilog wall time, agent down or hung included
UNSEEN_S = 8.0           # the agent's unseen_job_timeout_s here (default 60): longer than the gap between a
                         # job's last process and its epilog on a loaded 2-core machine, or the agent may
                         # forget a job just before its epilog releases it


def _v1_mode() -> str:
    """The agent's cgroup mode here: v1 where it finds a writable v1 cpu hierarchy (at its mount point,
    ``tests.cgroup_support.CPU``, where the agent's groups are checked), else off."""
    return "v1" if cgroupfs.v1_controller_available(ROOT, "cpu") is None else "off"


class ConfiguredAgent(AgentProc):
    """The agent as the unit runs it: everything from its config file (``--config``), nothing on the
    command line, so the endpoint the scripts must find is only in that file."""

    def __init__(self, cluster: Cluster, cgroup_mode: str):
        super().__init__(str(cluster.dir))
        self.endpoint = f"ipc://{cluster.dir}/run/agent.sock"
        self.state_dir = str(cluster.dir / "state")
        cluster.agent_config.write_text(
            f'endpoint = "{self.endpoint}"\n'
            f'state_dir = "{self.state_dir}"\n'
            'policy = "even"\n'
            'tick_s = 0.25\n'
            'heartbeat_s = 0.5\n'
            f'cgroup_mode = "{cgroup_mode}"\n'
            f"unseen_job_timeout_s = {UNSEEN_S}\n")
        cluster.agent_config.chmod(0o644)
        self.args = ["--config", str(cluster.agent_config)]


def _start_cluster(request, **kw) -> Cluster:
    cluster = Cluster(**kw)
    request.addfinalizer(cluster.stop)
    try:
        cluster.start()
    except RuntimeError as e:       # the machine cannot give the job user a Python, mount, ...
        pytest.skip(f"cannot start the Slurm cluster: {e}")
    return cluster


@pytest.fixture(scope="module")
def cluster(request):
    return _start_cluster(request)


@pytest.fixture
def agent(cluster, request):
    a = ConfiguredAgent(cluster, _v1_mode())

    def stop():
        if a.proc is not None and a.proc.poll() is None:
            os.kill(a.proc.pid, signal.SIGCONT)
            a.stop()
        shutil.rmtree(a.state_dir, ignore_errors=True)
        os.makedirs(a.state_dir, exist_ok=True)

    request.addfinalizer(stop)
    return a.start()


def _attached(agent: AgentProc, job) -> dict:
    return wait_for(lambda: (j := agent.job(job.id)) and j["ranks"] >= 1 and j["cpus"] is not None and j, 90,
                    interval=0.2, what=f"job {job.id} registered with its rank attached\n{job.output()}")


def _departed(agent: AgentProc, job_id: str) -> list[dict]:
    return [e for e in agent.events("job_departed") if e["job"] == job_id]


def _check_hooks(cluster: Cluster, job) -> None:
    for hook in ("prolog", "epilog"):
        s = cluster.hook_seconds(job.id, hook)
        assert s is not None and s < BOUND_S, f"{hook} of job {job.id} took {s} s"
    state = cluster.node_state()
    assert "DRAIN" not in state and "FAIL" not in state, state


def test_a_job_registers_attaches_and_is_released_with_no_cgroup_left(cluster, agent):
    job = cluster.submit("basic")
    j = _attached(agent, job)
    assert j["registered"] is True and j["source"] == "register" and j["uid"] == JOB_USER
    st = wait_for(lambda: (s := job.state()) and s.get("client", {}).get("connected") and s, 30,
                  what="the job's client connected")
    assert st["env"]["ADLOADER_ENDPOINT"] == agent.endpoint != "ipc:///run/adloader/agent.sock"  # from agent.toml
    assert st["env"]["ADLOADER_JOB_ID"] == job.id and st["client"]["job"] == job.id
    assert st["pid"] in j["pids"]
    group = Path(CPU, "adloader", job.id)
    if _v1_mode() == "v1":
        # the agent's view now, not the snapshot above: the workers may start after the rank attached
        wait_for(lambda: (now := agent.job(job.id)) and now["worker_pids"] and group.is_dir(), 30,
                 what=f"the job's workers and its group {group}")
    job.stop()
    assert job.wait_done() == "COMPLETED", job.output()
    wait_for(lambda: any(e["why"] == "released" for e in _departed(agent, job.id)), 15,
             what="the epilog's release")
    wait_for(lambda: not group.exists(), 15, what=f"{group} removed")
    assert agent.job(job.id) is None
    _check_hooks(cluster, job)
    # several prologs in the glob form, each run once, one after another (22.05: in reverse name order)
    assert sorted(cluster.hook_order(job.id, "prolog")) == ["end", "start"]
    lines = _script_lines(cluster, job)
    assert any("register" in l and ": ok" in l for l in lines) and any("release" in l and ": ok" in l for l in lines), lines


@pytest.mark.parametrize("fault", ["down", "hung"])
def test_jobs_complete_and_the_node_stays_up_when_the_agent_is(cluster, agent, fault):
    if fault == "down":
        agent.stop()
    else:
        os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        job = cluster.submit(f"fault-{fault}", max_s=8)
        assert job.wait_done(120) == "COMPLETED", job.output()
        _check_hooks(cluster, job)
        st = job.state()
        assert st.get("done") and st["steps"] > 0, st          # trained without the agent
    finally:
        if fault == "hung":
            os.kill(agent.proc.pid, signal.SIGCONT)
    lines = _script_lines(cluster, job)
    want = "agent down" if fault == "down" else "timeout"
    assert lines and all(want in l for l in lines), lines
    if fault == "hung":
        assert all("agent down" not in l for l in lines)


def _script_lines(cluster: Cluster, job) -> list[str]:
    """The scripts' log lines for ``job``, wherever they went: slurmd's log (their stderr, at debug2)
    and the scripts' own log file (no syslog here) -- or syslog, which this test does not read."""
    return [l for l in (cluster.slurmd_log() + "\n" + _read(cluster.script_log)).splitlines()
            if f"job {job.id}" in l and "adloader job" in l]


def _read(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def test_two_concurrent_jobs_share_and_an_opted_out_one_costs_nothing(cluster, agent):
    if cluster.cpus < 2:
        pytest.skip("needs 2 CPUs for two concurrent 1-CPU jobs")
    a = cluster.submit("pair-a")
    b = cluster.submit("pair-b")
    ja, jb = _attached(agent, a), _attached(agent, b)
    loader = agent.status()["agent"]["loader_cpus"]
    wait_for(lambda: all((j := agent.job(x.id)) and j["cpus"] == pytest.approx(loader / 2, abs=0.02) for x in (a, b)),
             20, what=f"an even split of {loader} between {ja['job']} and {jb['job']}")
    a.stop()
    b.stop()
    assert a.wait_done() == "COMPLETED" and b.wait_done() == "COMPLETED"

    out = cluster.submit("optout", env={"ADLOADER_DISABLE": "1"})
    user = cluster.submit("neighbour")
    wait_for(lambda: (j := agent.job(out.id)) and j["registered"], 60, what="the opted-out job registered by the prolog")
    _attached(agent, user)
    wait_for(lambda: out.state().get("steps"), 60, what="the opted-out job training")
    assert out.state()["client"] == {"active": False} and "ADLOADER_ENDPOINT" not in out.state()["env"]
    oj = agent.job(out.id)
    assert oj["ranks"] == 0 and oj["cpus"] is None and "until one of its ranks says hello" in oj["reason"]
    wait_for(lambda: agent.job(user.id)["cpus"] == pytest.approx(loader, abs=0.02), 20,
             what="the neighbour holding the whole loader budget")
    out.stop()
    user.stop()
    assert out.wait_done() == "COMPLETED" and user.wait_done() == "COMPLETED"
    for j in (a, b, out, user):
        _check_hooks(cluster, j)


def test_a_release_missed_while_the_agent_hung_is_made_up_for(cluster, agent):
    job = cluster.submit("missed")
    _attached(agent, job)
    os.kill(agent.proc.pid, signal.SIGSTOP)
    try:
        job.stop()
        assert job.wait_done() == "COMPLETED", job.output()
        _check_hooks(cluster, job)
    finally:
        os.kill(agent.proc.pid, signal.SIGCONT)
    assert not any(e["why"] == "released" for e in _departed(agent, job.id))   # the release never arrived
    gone = wait_for(lambda: _departed(agent, job.id), 10 + 3 * UNSEEN_S,
                    what="the agent forgetting the job by itself")
    assert "no process seen" in gone[0]["why"], gone
    assert agent.job(job.id) is None
    assert not Path(CPU, "adloader", job.id).exists()


# --- task/cgroup with ConstrainCores=yes: cooperative mode --------------------------------------------------
@pytest.fixture(scope="module")
def cgroup_cluster(request, cluster):
    if not os.path.exists(os.path.join(CPUSET, "cpuset.cpus")):
        pytest.skip(f"task/cgroup is tried here on a cgroup v1 cpuset hierarchy, and this machine has none "
                    f"(looked at {CPUSET})")
    cluster.stop()             # one cluster at a time: the tier stays within a few minutes and two CPUs
    return _start_cluster(request, task_plugin="task/affinity,task/cgroup", cgroup_mounts=("cpuset",), cgroup_conf="""\
        CgroupPlugin=cgroup/v1
        CgroupMountpoint={cgroup_mountpoint}
        CgroupAutomount=no
        ConstrainCores=yes
        ConstrainRAMSpace=no
        ConstrainSwapSpace=no
        ConstrainDevices=no
        """)


def _slurm_memory_groups() -> set[str]:
    """The groups named for Slurm at the top of the v1 memory hierarchy, wherever mountinfo says it is
    mounted (reading only: nothing here writes it; ``cgroupfs.v1_mount`` refuses the memory controller)."""
    found = set()
    for mount, _root, opts in cgroupfs.v1_mounts() or ():
        if "memory" in opts:
            try:
                found |= {n for n in os.listdir(mount) if "slurm" in n}
            except OSError:
                pass
    return found


def test_cooperative_mode_under_task_cgroup_keeps_workers_in_the_jobs_cpus(cgroup_cluster):
    c = cgroup_cluster
    memory_before = _slurm_memory_groups()
    a = ConfiguredAgent(c, "cooperative").start()
    try:
        job = c.submit("coop", cpus=1)
        j = _attached(a, job)
        assert a.status()["agent"]["cgroup_mode"] == "cooperative"
        st = wait_for(lambda: (s := job.state()) and s.get("client", {}).get("connected") and s, 30,
                      what="the job's client connected")
        cg = _read(Path(f"/proc/{st['pid']}/cgroup"))
        assert f"job_{job.id}" in cg, cg                                 # Slurm's own cgroup holds the job
        allowed = os.sched_getaffinity(st["pid"])
        assert len(allowed) == 1                                         # ConstrainCores: its one CPU
        workers = wait_for(lambda: a.job(job.id)["worker_pids"], 30, what="worker pids reported")
        for w in workers:
            try:
                assert os.sched_getaffinity(w) <= allowed
            except ProcessLookupError:
                pass
        assert not Path(CPU, "adloader", job.id).exists()             # cooperative: no cgroup of ours
        job.stop()
        assert job.wait_done() == "COMPLETED", job.output()
        wait_for(lambda: any(e["why"] == "released" for e in _departed(a, job.id)), 15,
                 what=f"released: {_departed(a, job.id)} {[l for l in c.slurmd_log().splitlines() if 'adloader' in l][-4:]}")
        _check_hooks(c, job)
        assert not any("memory" in line for line in _read(Path("/proc/mounts")).splitlines()
                       if str(c.dir) in line)                          # slurmd saw no memory hierarchy
        assert _slurm_memory_groups() == memory_before                 # and made no group in it
    finally:
        a.stop()
