"""A real single-node Slurm cluster: the harness of the Slurm test tier (tests/test_slurm_cluster.py) and of
``python -m evaluation.slurm_bench`` (prolog/epilog wall times with the agent up, down and hung).

Debian 12's slurm-wlm 22.05 (slurmctld, slurmd, slurm-client) and munge, started by the test as root
on loopback with everything of its own: a temporary directory (``/tmp/adlslurm-*``) holding
``slurm.conf``, ``cgroup.conf``, a fresh munge key and socket, the controller's state, slurmd's spool,
the logs and pid files; TCP ports picked free; a FirstJobId of its own (job ids do not collide with
another run's cgroup names). Jobs run as an ordinary user (``JOB_USER``, nobody) through real
``sbatch``; their Python (the project's interpreter and venv) is reached through read-only bind mounts
under the cluster directory when the user cannot traverse the real paths (e.g. under /root).

The A-Dloader side is installed as ``install-service`` would (``slurm_script``): the prolog, epilog and
TaskProlog with their install-time lines pointed at this cluster's agent config and log file, the
prolog and epilog in the **glob form** (``Prolog=<dir>/prolog.d/*``) beside two timing hooks that
record when the glob's first and last programs ran (bash's EPOCHREALTIME; no program needed).

``Cluster.stop()`` cancels every job, waits for them to end, stops slurmd, slurmctld and munged, kills
any slurmstepd or job process of this cluster that is left, unmounts what it mounted and removes its
directory; it is safe to call after a failed start. Every wait polls a condition against a deadline.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Optional

from evaluation.poll import wait_for

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("adloader", "agent", "predictor", "evaluation")   # pyproject.toml: [tool.setuptools.packages.find]


JOB_USER = 65534            # nobody
DAEMONS = ("slurmctld", "slurmd", "munged")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "munge")
SEARCH = ("/usr/sbin", "/usr/bin", "/sbin", "/bin")

# The training job: a real adloader.DataLoader loop with a CPU-bound map-style dataset, run until a stop
# file appears (or max_s); it writes its client's view (connected, endpoint, job, workers) every few steps.
TRAIN = textwrap.dedent('''
    import json, os, sys, time
    import torch
    from torch.utils.data import Dataset
    from adloader import DataLoader, client

    class Work(Dataset):
        def __len__(self):
            return 1_000_000
        def __getitem__(self, i):
            x = 0
            for k in range(3000):
                x += k * k
            return torch.tensor([i, x % 7])

    out, stop, max_s = sys.argv[1], sys.argv[2], float(sys.argv[3])

    def dump(extra):
        doc = {"pid": os.getpid(), "uid": os.getuid(), "client": client.state(),
               "env": {k: v for k, v in os.environ.items() if k.startswith(("ADLOADER_", "SLURM_JOB_ID"))}, **extra}
        with open(out + ".tmp", "w") as f:
            json.dump(doc, f)
        os.replace(out + ".tmp", out)

    loader = DataLoader(Work(), batch_size=4, shuffle=False, num_workers=2, max_workers=4)
    t0 = time.monotonic()
    steps = 0
    for batch in loader:
        steps += 1
        time.sleep(0.02)                      # the "GPU" step
        if steps % 5 == 0:
            dump({"steps": steps, "workers": loader.stats().get("workers")})
        if os.path.exists(stop) or time.monotonic() - t0 > max_s:
            break
    dump({"steps": steps, "done": True, "stopped": os.path.exists(stop)})
''')


def _read_text(p: Path) -> str:
    try:
        return p.read_text(errors="replace")
    except OSError:
        return ""


def find_program(name: str) -> Optional[str]:
    for d in SEARCH:
        p = os.path.join(d, name)
        if os.access(p, os.X_OK):
            return p
    return shutil.which(name)


def why_not() -> str:
    """Why this machine cannot run the tier ("" when it can)."""
    if os.getuid() != 0:
        return "the Slurm tier needs root (it starts slurmctld, slurmd and munged)"
    missing = [n for n in DAEMONS + CLIENTS if find_program(n) is None]
    if missing:
        return (f"Debian's Slurm packages are not installed (missing {', '.join(missing)}): "
                "apt-get install slurmctld slurmd slurm-client munge (.ci/run does it)")
    if not (Path(sys.prefix) / "bin" / "adloader").exists():
        return f"{sys.prefix}/bin/adloader is missing: run the tier from the project's venv (./run tests)"
    return ""


def free_port() -> int:
    """A loopback TCP port nobody holds now, below the kernel's ephemeral range (for a server started
    later by another process: a rendezvous, a daemon). ``bind(0)`` and ``connect()`` take their ports
    from that range, so such a port is not taken between this call and the server's bind, and cannot
    become a client's own port: a client retrying a connect to a port nobody listens on yet can be
    given that very port and connect to itself, and then both ends wait forever (a TCP self-connect)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.SystemRandom()
    for _ in range(100 if low > 2048 else 0):
        port = rng.randrange(max(1024, low - 10000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:   # no room below the range
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def terminate(p: subprocess.Popen, wait_s: float = 15) -> None:
    """SIGTERM (after SIGCONT, for a stopped process), then SIGKILL if it is still there after ``wait_s``."""
    if p.poll() is not None:
        return
    p.send_signal(signal.SIGCONT)
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(wait_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def signal_pids(pids, sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each pid that is still there (the harnesses' leftovers, a hung rank's tree)."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass


class Cluster:
    """One slurmctld + one slurmd + munged, on loopback, under ``self.dir``."""

    def __init__(self, *, task_plugin: str = "task/affinity", cgroup_conf: Optional[str] = None,
                 cgroup_mounts: tuple[str, ...] = (), agent_config: Optional[Path] = None):
        self.dir = Path(tempfile.mkdtemp(prefix="adlslurm-"))
        os.chmod(self.dir, 0o755)
        self.task_plugin = task_plugin
        self.cgroup_conf = cgroup_conf         # cgroup.conf: {dir} and {cgroup_mountpoint} are filled in
        self.cgroup_mounts = cgroup_mounts     # v1 controllers to mount under cgroup_mountpoint
        self.cgroup_mountpoint = self.dir / "cgroup"    # cgroup.conf's CgroupMountpoint
        self.node = "adlnode"
        self.host = socket.gethostname().split(".")[0]
        self.cpus = os.cpu_count() or 1
        self.first_job_id = 10_000_000 + (os.getpid() % 5000) * 1000 + int(time.time()) % 1000
        self.agent_config = agent_config or (self.dir / "agent.toml")
        self.conf = self.dir / "etc" / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        self.mounts: list[Path] = []
        self.cgroup_before: dict[Path, set[str]] = {}
        self.python = sys.executable
        self.pythonpath = ""
        self.libpath = ""
        self.job_ids: list[str] = []
        self.jobs_dir = self.dir / "jobs"
        self.hook_times = self.dir / "hook-times.log"
        self.script_log = self.dir / "log" / "adloader-slurm.log"

    # --- setup ----------------------------------------------------------------------------------------
    def start(self) -> "Cluster":
        for sub in ("etc", "ctld", "spool", "log", "munge", "munge-key", "jobs", "prolog.d", "epilog.d",
                    "prefix/slurm", "mnt", "run", "state"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        for sub in ("munge", "jobs", "mnt", "run", "prefix", "prefix/slurm"):
            os.chmod(self.dir / sub, 0o755)
        os.chmod(self.dir / "jobs", 0o1777)
        os.chmod(self.dir / "munge-key", 0o700)
        self._install_adloader()
        self._job_python()
        self._write_conf()
        self._start_munge()
        self._mount_cgroups()
        env = self.env()
        self.procs["slurmctld"] = subprocess.Popen(
            [find_program("slurmctld"), "-D", "-f", str(self.conf)], env=env,
            stdout=open(self.dir / "log" / "slurmctld.out", "w"), stderr=subprocess.STDOUT)
        self.procs["slurmd"] = subprocess.Popen(
            [find_program("slurmd"), "-D", "-f", str(self.conf), "-N", self.node], env=env,
            stdout=open(self.dir / "log" / "slurmd.out", "w"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: self._alive_or_raise() and "IDLE" in self.node_state(), 60, interval=0.2,
                     what="slurmd registered and the node idle")
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.logs()}") from None
        return self

    def _alive_or_raise(self) -> bool:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise AssertionError(f"{name} exited with {p.returncode}\n{self.logs()}")
        return True

    def _install_adloader(self) -> None:
        """The scripts as install-service writes them, PREFIX/venv being this project's venv."""
        from agent.commands.install_service import SLURM_SCRIPTS, slurm_script

        prefix = self.dir / "prefix"
        venv = prefix / "venv"
        if not venv.exists():
            venv.symlink_to(sys.prefix)
        for name in SLURM_SCRIPTS:
            p = prefix / "slurm" / name
            p.write_text(slurm_script(name, str(prefix), config=str(self.agent_config), log_file=str(self.script_log)))
            p.chmod(0o755)
        for hook in ("prolog", "epilog"):
            d = self.dir / f"{hook}.d"
            (d / "50-adloader").symlink_to(prefix / "slurm" / f"{hook}.sh")
            for name, what in (("00-first", "start"), ("99-last", "end")):
                p = d / name
                p.write_text(f'#!/bin/bash\nprintf "%s {hook}-{what} %s\\n" "$EPOCHREALTIME" "$SLURM_JOB_ID" '
                             f'>>{self.hook_times}\nexit 0\n')
                p.chmod(0o755)

    def _job_python(self) -> None:
        """The job user's interpreter and import path: the project's own, through read-only bind mounts
        where that user cannot traverse the real paths (a Python under /root)."""
        purelib = sysconfig.get_paths()["purelib"]
        sources = {"py": sys.base_prefix, "site": purelib, "src": str(REPO)}
        if os.stat(REPO).st_mode & 0o005 != 0o005:
            # a checkout only its owner may enter (a clone into ``mktemp -d``): a bind mount keeps the
            # directory's mode, so the job user gets a copy of the project's packages instead
            src = self.dir / "src"
            for pkg in PACKAGES:
                shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"),
                                dirs_exist_ok=True)
            for path in [src, *src.rglob("*")]:
                path.chmod(0o755 if path.is_dir() else 0o644)
            sources["src"] = str(src)
        where = {}
        for name, src in sources.items():
            target = self.dir / "mnt" / name
            target.mkdir(exist_ok=True)
            r = subprocess.run(["mount", "--bind", "-o", "ro", src, str(target)], capture_output=True, text=True)
            if r.returncode != 0:   # older mount(8): bind, then remount read-only
                r = subprocess.run(["mount", "--bind", src, str(target)], capture_output=True, text=True)
            if r.returncode == 0:
                self.mounts.append(target)
                where[name] = str(target)
            else:
                where[name] = src
        exe = os.path.realpath(os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}"))
        if not os.path.exists(exe):
            exe = os.path.realpath(sys._base_executable)  # type: ignore[attr-defined]
        self.python = exe.replace(sys.base_prefix, where["py"], 1) if exe.startswith(sys.base_prefix) else exe
        self.pythonpath = f"{where['site']}:{where['src']}"
        self.libpath = os.path.join(where["py"], "lib")     # a shared libpython found by an rpath under /root
        probe = subprocess.run([self.python, "-c", "import torch, zmq, psutil, adloader; print('ok')"],
                               user=JOB_USER, group=JOB_USER, extra_groups=[], cwd="/",
                               env={"PYTHONPATH": self.pythonpath, "LD_LIBRARY_PATH": self.libpath,
                                    "PATH": "/usr/bin:/bin", "HOME": "/tmp"},
                               capture_output=True, text=True, timeout=120)
        if probe.stdout.strip() != "ok":
            raise RuntimeError(f"uid {JOB_USER} cannot run the project's Python ({self.python}, "
                               f"PYTHONPATH={self.pythonpath}): {probe.stderr.strip()[-500:]}")
        train = self.dir / "train.py"
        train.write_text(TRAIN)
        train.chmod(0o644)

    def _write_conf(self) -> None:
        d = self.dir
        self.ctld_port, self.slurmd_port = free_port(), free_port()
        conf = f"""\
            ClusterName=adl{os.getpid() % 100000}
            SlurmctldHost={self.host}(127.0.0.1)
            SlurmctldPort={self.ctld_port}
            SlurmdPort={self.slurmd_port}
            AuthType=auth/munge
            CredType=cred/munge
            AuthInfo=socket={d}/munge/munge.sock
            SlurmUser=root
            SlurmdUser=root
            StateSaveLocation={d}/ctld
            SlurmdSpoolDir={d}/spool
            SlurmctldPidFile={d}/slurmctld.pid
            SlurmdPidFile={d}/slurmd.pid
            SlurmctldLogFile={d}/log/slurmctld.log
            SlurmdLogFile={d}/log/slurmd.log
            SlurmctldDebug=info
            SlurmdDebug=debug2
            FirstJobId={self.first_job_id}
            ProctrackType=proctrack/linuxproc
            TaskPlugin={self.task_plugin}
            SelectType=select/cons_tres
            SelectTypeParameters=CR_Core
            MpiDefault=none
            JobAcctGatherType=jobacct_gather/none
            AccountingStorageType=accounting_storage/none
            JobCompType=jobcomp/none
            ReturnToService=2
            SlurmdTimeout=60
            InactiveLimit=0
            MinJobAge=300
            KillWait=5
            PrologFlags=Alloc
            Prolog={d}/prolog.d/*
            Epilog={d}/epilog.d/*
            TaskProlog={d}/prefix/slurm/taskprolog.sh
            NodeName={self.node} NodeHostname={self.host} NodeAddr=127.0.0.1 CPUs={self.cpus} State=UNKNOWN
            PartitionName=adl Nodes={self.node} Default=YES MaxTime=INFINITE State=UP
            """
        self.conf.write_text(textwrap.dedent(conf))
        if self.cgroup_conf is not None:
            (d / "etc" / "cgroup.conf").write_text(textwrap.dedent(self.cgroup_conf).format(
                dir=d, cgroup_mountpoint=self.cgroup_mountpoint))
        for f in (self.conf, d / "etc" / "cgroup.conf"):
            if f.exists():
                f.chmod(0o644)

    def _start_munge(self) -> None:
        key = self.dir / "munge-key" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        m = self.dir / "munge"
        self.procs["munged"] = subprocess.Popen(
            [find_program("munged"), "-F", "-f", f"--socket={m}/munge.sock", f"--key-file={key}",
             f"--pid-file={m}/munged.pid", f"--log-file={self.dir}/log/munged.log", f"--seed-file={m}/munged.seed"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        wait_for(lambda: (m / "munge.sock").exists() or self.procs["munged"].poll() is not None, 20,
                 what="munged's socket")
        if self.procs["munged"].poll() is not None:
            raise RuntimeError(f"munged exited {self.procs['munged'].returncode}: {self.logs()}")

    def _mount_cgroups(self) -> None:
        """Only the v1 controllers asked for, mounted under our directory for slurmd (cgroup.conf's
        CgroupMountpoint, CgroupAutomount=no): Slurm cannot reach any other hierarchy (the sandbox's
        memory hierarchy above all). Each is mounted by its controller's name: Slurm's cgroup/v1 plugin
        builds ``<CgroupMountpoint>/<controller>`` itself (xcgroup_ns_create, src/plugins/cgroup/v1/
        xcgroup.c) and does not read mountinfo. The groups Slurm leaves there (``slurm_<node>/...``)
        are removed by ``stop``."""
        for ctl in self.cgroup_mounts:
            target = self.cgroup_mountpoint / ctl
            target.mkdir(parents=True, exist_ok=True)
            r = subprocess.run(["mount", "-t", "cgroup", "-o", ctl, f"adlslurm-{ctl}", str(target)],
                               capture_output=True, text=True)
            if r.returncode != 0:
                raise RuntimeError(f"cannot mount the cgroup v1 {ctl} hierarchy for slurmd: {r.stderr.strip()}")
            self.mounts.append(target)
            self.cgroup_before[target] = {p.name for p in target.iterdir() if p.is_dir()}

    def _remove_slurm_groups(self) -> None:
        for target, before in self.cgroup_before.items():
            for top in [p for p in target.iterdir() if p.is_dir() and p.name not in before]:
                for d in sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)) + [top]:
                    try:
                        d.rmdir()
                    except OSError:
                        pass

    # --- talking to it ----------------------------------------------------------------------------------
    def env(self) -> dict[str, str]:
        return {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SLURM_CONF": str(self.conf), "HOME": "/tmp", "LANG": "C"}

    def run(self, *argv: str, user: Optional[int] = None, timeout: float = 30) -> str:
        kw = dict(user=user, group=user, extra_groups=[]) if user is not None else {}
        p = subprocess.run([find_program(argv[0]), *argv[1:]], env=self.env(), capture_output=True, text=True,
                           timeout=timeout, cwd=str(self.jobs_dir), **kw)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {p.returncode}: {p.stderr.strip()}")
        return p.stdout

    def node_state(self) -> str:
        try:
            out = self.run("scontrol", "show", "node", self.node, "-o")
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""
        m = re.search(r"\bState=(\S+)", out)
        return m.group(1) if m else ""

    def job_state(self, job: str) -> str:
        try:
            out = self.run("scontrol", "show", "job", job, "-o")
        except (RuntimeError, subprocess.TimeoutExpired):
            return ""
        m = re.search(r"\bJobState=(\S+)", out)
        return m.group(1) if m else ""

    def submit(self, name: str, *, max_s: float = 120, cpus: int = 1, env: Optional[dict] = None) -> "Job":
        """``sbatch`` the training loop as JOB_USER; returns its Job (id, state/stop files)."""
        job = Job(self, name)
        script = self.jobs_dir / f"{name}.sh"
        script.write_text(
            "#!/bin/bash\n"
            f"export PYTHONPATH={self.pythonpath} LD_LIBRARY_PATH={self.libpath}\n"
            f"exec {self.python} {self.dir}/train.py {job.state_file} {job.stop_file} {max_s}\n")
        script.chmod(0o755)
        exports = ",".join(["ALL", *(f"{k}={v}" for k, v in (env or {}).items())])
        out = self.run("sbatch", "--parsable", f"--job-name={name}", f"--cpus-per-task={cpus}", "--ntasks=1",
                       f"--output={self.jobs_dir}/{name}.out", f"--chdir={self.jobs_dir}", f"--export={exports}",
                       str(script), user=JOB_USER)
        job.id = out.strip().split(";")[0]
        self.job_ids.append(job.id)
        return job

    def hook_seconds(self, job: str, hook: str) -> Optional[float]:
        """Wall seconds between the glob's two marker programs (``00-first``, ``99-last``) for ``job``: ours
        (``50-adloader``) runs between them. Order-blind: slurmd 22.05 runs a glob's matches one after
        another in reverse name order (99-last first), see ``hook_order``."""
        t = {}
        try:
            for line in self.hook_times.read_text().splitlines():
                ts, what, jid = line.split()
                if jid == job and what.startswith(hook + "-"):
                    t[what.split("-")[1]] = float(ts)
        except (OSError, ValueError):
            return None
        return abs(t["end"] - t["start"]) if {"start", "end"} <= set(t) else None

    def hook_order(self, job: str, hook: str) -> list[str]:
        """The markers of ``hook`` for ``job`` in the order they ran (``["end", "start"]``: reverse order)."""
        seen = []
        for line in _read_text(self.hook_times).splitlines():
            parts = line.split()
            if len(parts) == 3 and parts[2] == job and parts[1].startswith(hook + "-"):
                seen.append((float(parts[0]), parts[1].split("-")[1]))
        return [what for _, what in sorted(seen)]

    def slurmd_log(self) -> str:
        try:
            return (self.dir / "log" / "slurmd.log").read_text(errors="replace")
        except OSError:
            return ""

    def logs(self) -> str:
        out = []
        for name in ("slurmctld.log", "slurmd.log", "munged.log", "slurmctld.out", "slurmd.out"):
            try:
                out.append(f"--- {name}\n" + (self.dir / "log" / name).read_text(errors="replace")[-3000:])
            except OSError:
                pass
        return "\n".join(out)

    # --- teardown ---------------------------------------------------------------------------------------
    def stop(self) -> None:
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                self.run("scancel", "--partition=adl", timeout=15)
                wait_for(lambda: not self.run("squeue", "-h", "-o", "%i").strip(), 30, interval=0.2,
                         what="every job ended")
            except (AssertionError, RuntimeError, subprocess.TimeoutExpired):
                pass
        for name in ("slurmd", "slurmctld", "munged"):
            if name in self.procs:
                terminate(self.procs[name])
        # anything of this cluster's jobs still alive: slurmstepd (by its title) and the jobs' processes
        ids = {j: JOB_USER for j in self.job_ids}
        for _ in range(3):
            left = self._job_pids(ids)
            if not left:
                break
            signal_pids(left)
            time.sleep(0.2)
        self._remove_slurm_groups()
        for m in reversed(self.mounts):
            subprocess.run(["umount", "-l", str(m)], capture_output=True)
        self.mounts.clear()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _job_pids(self, ids: dict[str, int]) -> list[int]:
        from agent import jobprocs

        pids = []
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            base = f"/proc/{name}"
            try:
                comm = Path(base, "comm").read_bytes().strip()
                if comm == b"slurmstepd":
                    if jobprocs.slurmstepd_job(Path(base, "cmdline").read_bytes()) in ids:
                        pids.append(int(name))
                    continue
                if os.stat(base).st_uid == JOB_USER and jobprocs.environ_job_ids(Path(base, "environ").read_bytes()) & set(ids):
                    pids.append(int(name))
            except OSError:
                continue
        return pids


class Job:
    def __init__(self, cluster: Cluster, name: str):
        self.cluster = cluster
        self.name = name
        self.id = ""
        self.state_file = cluster.jobs_dir / f"{name}.json"
        self.stop_file = cluster.jobs_dir / f"{name}.stop"

    def state(self) -> dict:
        import json

        try:
            return json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}

    def stop(self) -> None:
        self.stop_file.write_text("stop\n")

    def slurm_state(self) -> str:
        return self.cluster.job_state(self.id)

    def wait_done(self, timeout: float = 90) -> str:
        """Wait until Slurm says the job has ended (any terminal state) and its epilog has run."""
        terminal = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL")
        wait_for(lambda: self.slurm_state() in terminal and self.cluster.hook_seconds(self.id, "epilog") is not None,
                 timeout, interval=0.2, what=f"job {self.name} ({self.id}) to end and its epilog to run")
        return self.slurm_state()

    def output(self) -> str:
        try:
            return (self.cluster.jobs_dir / f"{self.name}.out").read_text(errors="replace")
        except OSError:
            return ""
