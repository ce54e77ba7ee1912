"""Helpers for the agent/client component tests: a real `adloader agent` process, real training-like
processes, status queries. Not a test module (no tests here); imported by tests/test_agent*.py and
tests/test_client*.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path
from typing import Optional

from tests.conftest import adloader_cmd, repo_env, wait_for

# A training process with a small fake loader: resize() starts/stops real `sleep` worker processes,
# stats() returns monotonic totals like adloader.DataLoader.stats(); it attaches through
# adloader.client.attach and writes the client's state to STATE_FILE every 0.1 s.
FAKE_TRAINER = textwrap.dedent('''
    import faulthandler, json, os, signal, subprocess, sys, time
    import psutil, zmq
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    import logging
    logging.basicConfig(level=logging.DEBUG, format="%(asctime)s %(name)s %(message)s")
    import agent  # a client-only process: declares itself torch-free (adloader/__init__.py), saves ~1 s per start
    from adloader import client

    if os.environ.get("FAKE_SETUID"):
        # become another user after the interpreter has loaded what it needs (the interpreter itself
        # lives under /root here, which other uids cannot traverse)
        uid = int(os.environ["FAKE_SETUID"])
        os.setgroups([]); os.setgid(uid); os.setuid(uid)

    class FakeLoader:
        def __init__(self, workers, max_workers=None, batch_size=8):
            self.num_workers = 0
            self.requested_workers = workers
            self.max_workers = max_workers
            self.batch_size = batch_size
            # samples counted a step: the batch size unless a test makes the counters disagree with it
            self.samples_per_step = int(os.environ.get("FAKE_SAMPLES_PER_STEP") or batch_size)
            self._procs = []
            self._t0 = time.monotonic()
            self.resize(workers)

        def resize(self, n):
            while len(self._procs) < n:
                self._procs.append(subprocess.Popen(["sleep", "600"]))
            while len(self._procs) > n:
                p = self._procs.pop(); p.kill(); p.wait()
            self.num_workers = n

        def worker_pids(self):
            return [p.pid for p in self._procs]

        def stats(self):
            wall = up = time.monotonic() - self._t0
            away = 0.0
            if os.environ.get("FAKE_AWAY"):   # "A,B": the loop stands still (out of next()) from A s to B s
                a, b = (float(x) for x in os.environ["FAKE_AWAY"].split(","))
                if a <= wall < b:
                    up, away = a, wall - a
                elif wall >= b:
                    up = wall - (b - a)
            steps = int(up * 20)
            return {"steps": steps, "samples": steps * self.samples_per_step, "batches": steps, "epoch": 0,
                    "workers": self.num_workers, "live_workers": self.num_workers,
                    "max_workers": self.max_workers, "requested_workers": self.requested_workers,
                    "batch_size": self.batch_size, "data_wait_s": up * 0.3, "compute_s": up * 0.7,
                    "worker_cpu_s": up * float(os.environ.get("FAKE_WORKER_CORES") or 0.5), "worker_wall_s": up * 1.0, "worker_runq_s": up * 0.1,
                    "worker_blocked_s": up * 0.4, "resizes": 0, "worker_restarts": 0, "redispatched": 0,
                    "uptime_s": wall, "away_s": away, "rates": {},
                    **({"steps_left": max(0, int(os.environ["FAKE_TOTAL_STEPS"]) - steps)}
                       if os.environ.get("FAKE_TOTAL_STEPS") else {})}

        def close(self):
            client.detach(self)
            self.resize(0)

    def burn_while_away():   # FAKE_AWAY_BURN=1: while away, the process runs (a validation pass: its CPU)
        a, b = (float(x) for x in os.environ["FAKE_AWAY"].split(","))
        t0 = time.monotonic()
        while True:
            wall = time.monotonic() - t0
            if wall >= b:
                return
            if wall < a:
                time.sleep(0.05)
            else:
                end = time.thread_time() + 0.01
                while time.thread_time() < end:
                    pass

    if os.environ.get("FAKE_AWAY_BURN"):
        import threading
        threading.Thread(target=burn_while_away, daemon=True).start()
    state_file = sys.argv[1]
    run_s = float(sys.argv[2]) if len(sys.argv) > 2 else 600
    loader = FakeLoader(int(os.environ.get("FAKE_WORKERS", "2")),
                        max_workers=int(os.environ["FAKE_MAX_WORKERS"]) if os.environ.get("FAKE_MAX_WORKERS") else None)
    client.attach(loader)
    t_end = time.monotonic() + run_s
    try:
        while time.monotonic() < t_end:
            st = dict(client.state()); st["num_workers"] = loader.num_workers; st["worker_pids"] = loader.worker_pids()
            tmp = state_file + ".tmp"
            with open(tmp, "w") as f:
                json.dump(st, f)
            os.replace(tmp, state_file)
            time.sleep(0.1)
    finally:
        loader.close()
''')


class BurningDataset:
    """A map-style dataset whose every sample costs ``cpu_s`` of its worker's CPU (a validation set's
    decoding): a real loader's workers busy on the CPU. Used in-process and by training scripts run as
    subprocesses (``from tests.agentd_support import BurningDataset``)."""

    def __init__(self, n: int, cpu_s: float):
        self.n, self.cpu_s = n, cpu_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        from adloader.synthetic import burn_cpu

        burn_cpu(self.cpu_s)
        return i


_held: list = []


class HoldingDataset:
    """A map-style dataset whose worker, from its first sample on, holds ``mib`` MiB of private memory of
    its own (written, so resident and unique to it: a validation set's decoded copy)."""

    def __init__(self, n: int, mib: int):
        self.n, self.mib = n, mib

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not _held:
            _held.append(b"\x01" * (self.mib << 20))
        return i


class FakeRouter:
    """A real ROUTER on an ipc socket, served by a thread: each request is decoded, kept in
    ``received``, and answered with the raw frames ``reply(msg)`` returns (none: no answer)."""

    def __init__(self, path: str):
        import zmq

        self.endpoint = f"ipc://{path}"
        self.received: list[dict] = []
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(self.endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def reply(self, msg: dict) -> list[bytes]:
        raise NotImplementedError

    def _serve(self):
        from adloader import protocol

        while not self._stop.is_set():
            if not self._sock.poll(20):
                continue
            ident, data = self._sock.recv_multipart()
            msg = protocol.decode(data)
            self.received.append(msg)
            for frame in self.reply(msg):
                self._sock.send_multipart([ident, frame])

    def close(self):
        self._stop.set()
        self._thread.join(5)
        self._sock.close(0)
        self._ctx.term()


def short_dir() -> str:
    """A short directory (ipc:// paths must stay under ~100 chars), readable by other uids."""
    d = tempfile.mkdtemp(prefix="adl")
    os.chmod(d, 0o755)
    return d


class AgentProc:
    """A real `adloader agent` process on an ipc endpoint under ``base``."""

    def __init__(self, base: str, *extra: str, env: Optional[dict] = None, state_dir: Optional[str] = None,
                 wrap: tuple[str, ...] = ()):
        """``wrap``: a command line the agent runs under (e.g. ``prlimit --nofile=1024:1024 --``)."""
        self.base = base
        self.wrap = tuple(wrap)
        self.endpoint = f"ipc://{base}/agent.sock"
        self.sock_path = f"{base}/agent.sock"
        self.state_dir = state_dir or f"{base}/state"
        self.log_path = f"{base}/agent-{time.monotonic_ns()}.log"
        if "--cgroup-mode" not in extra:   # component tests touch no cgroup unless they ask to
            extra = (*extra, "--cgroup-mode", "off")
        self.args = ["--endpoint", self.endpoint, "--state-dir", self.state_dir, *extra]
        self.env = repo_env(**(env or {}))
        self.proc: Optional[subprocess.Popen] = None

    def start(self, wait: bool = True) -> "AgentProc":
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen([*self.wrap, *adloader_cmd("agent", *self.args)], env=self.env, stdout=self._log,
                                     stderr=subprocess.STDOUT)
        if wait:
            wait_for(lambda: self.events("agent_started") or self.proc.poll() is not None, 20, what="agent start")
            assert self.proc.poll() is None, self.log()
        return self

    def log(self) -> str:
        try:
            return Path(self.log_path).read_text()
        except OSError:
            return ""

    def events(self, name: Optional[str] = None) -> list[dict]:
        out = []
        for line in self.log().splitlines():
            try:
                d = json.loads(line)
            except ValueError:
                continue
            if name is None or d.get("event") == name:
                out.append(d)
        return out

    def status(self, timeout_s: float = 5.0) -> dict:
        from agent import status

        return status.query(self.endpoint, timeout_s=timeout_s)

    def job(self, job_id: str) -> Optional[dict]:
        try:
            doc = self.status()
        except RuntimeError:
            return None
        return next((j for j in doc["jobs"] if j["job"] == job_id), None)

    def stop(self, sig=signal.SIGTERM, timeout: float = 10) -> int:
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        self._log.close()
        return rc

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self._log.close()


class Trainer:
    """A training-like process running FAKE_TRAINER (or a given script) with the agent's endpoint."""

    def __init__(self, base: str, endpoint: str, *, job: Optional[str] = None, workers: int = 2,
                 run_s: float = 600, env: Optional[dict] = None, user: Optional[int] = None,
                 script: Optional[str] = None, wrap: tuple[str, ...] = ()):
        """``wrap``: a command line the interpreter runs under (e.g. ``unshare --pid --fork``); then
        ``pid`` is the wrapper's."""
        sdir = base
        if user is not None:
            sdir = f"{base}/u{user}"
            os.makedirs(sdir, exist_ok=True)
            os.chmod(sdir, 0o777)
        self.state_file = f"{sdir}/trainer-{time.monotonic_ns()}.json"
        script_path = f"{base}/fake_trainer.py"
        if not os.path.exists(script_path):
            Path(script_path).write_text(FAKE_TRAINER)
            os.chmod(script_path, 0o644)
        extra = {"ADLOADER_ENDPOINT": endpoint, "FAKE_WORKERS": str(workers)}
        if job is not None:
            extra["ADLOADER_JOB_ID"] = job
        for k in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE"):
            extra.setdefault(k, "")
        extra.update(env or {})
        e = repo_env(**extra)
        if user is not None:
            e["FAKE_SETUID"] = str(user)
            e["HOME"] = sdir
        argv = [*wrap, sys.executable, script or script_path, self.state_file, str(run_s)]
        self.proc = subprocess.Popen(argv, env=e, cwd=base,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.pid = self.proc.pid

    def state(self) -> dict:
        try:
            with open(self.state_file) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    def kill(self, sig=signal.SIGKILL) -> None:
        import psutil

        pids = set(self.state().get("worker_pids") or [])
        try:   # the loader's workers as they are now (the state file may lag a resize)
            pids |= {c.pid for c in psutil.Process(self.pid).children(recursive=True)}
        except psutil.Error:
            pass
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(10)
        for p in pids:   # the fake loader's `sleep` workers die with their parent only on a clean exit
            try:
                os.kill(p, signal.SIGKILL)
            except OSError:
                pass

    def dump(self) -> str:
        """Diagnostics for a failed wait: the client state and every thread's stack (faulthandler)."""
        st = self.state()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGUSR1)
            time.sleep(0.5)
            self.kill()
        return f"state={st}\noutput:\n{self.proc.stdout.read().decode(errors='replace')[-4000:]}"

    def output(self) -> str:
        if self.proc.poll() is None:
            return ""
        return self.proc.stdout.read().decode(errors="replace")
