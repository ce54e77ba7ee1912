"""What the agent holds while one ordinary user floods it, with a victim (another ordinary uid) served.

    sudo python -m evaluation.security_bench [--seconds 10] [--scenarios connections,churn,...]
                                             [--repeats 1] [--tick-s 1.0] [--agent-repo DIR]
                                             [--out bench-out/security_bench.json]

Needs root (the agent runs as root, the attacker as uid 65534, the victim as uid 65533). For each
scenario and repeat: a fresh `adloader agent` (cgroup mode off), a victim training process (the real
``adloader.client`` over a fake loader: hello, a report a second, directives), a 3 s quiet window,
then the attack (``evaluation.attacks``) for --seconds while this process samples every 0.25 s:
``adloader status`` round trip, the agent's RSS, and its tick counter: the longest time the counter
did not move, less one tick, is how late a tick started (measured from outside, so the same for an
older agent; ``--agent-repo`` runs another checkout's agent, e.g. the code before the fix).
Per scenario it reports the attack rate the attacker achieved (messages/s, connections/s, bytes/s),
the agent's CPU (% of one core over the attack window) and peak RSS, status p50/max, the latest tick
start, the victim's reports during the attack and whether it lost its connection (reconnects), and
"held": tick never more than 2 s late, status always under 1 s, victim never reconnected and still
reporting. Prints a table and writes JSON.

Scenarios:
    idle         no attack (the baseline)
    connections  1,100 raw connections held open (more than the 1,024 open files of issue 16.1)
    churn        connections opened and closed as fast as one process can
    messages     32 connections sending small valid messages as fast as libzmq takes them
    bigframes    60 connections sending 64 KB frames as fast as libzmq takes them
    expensive    register messages of 200 live pids each (the costliest valid message)
    registers    300 registrations without processes
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import psutil  # noqa: E402

from evaluation.flags import above, at_least, finite_float, names_arg, path_arg, plain_int  # noqa: E402

ATTACKER, VICTIM = 65534, 65533
SCENARIOS = {
    "idle": None,
    "connections": lambda s: ["connections", "1100", str(s)],
    "churn": lambda s: ["churn", str(s)],
    "messages": lambda s: ["messages", "32", str(s)],
    "bigframes": lambda s: ["bigframes", "60", str(s)],
    "expensive": lambda s: ["expensive", str(s)],
    "registers": lambda s: ["register", "300"],
}

VICTIM_SCRIPT = textwrap.dedent('''
    import json, os, sys, time
    from adloader import client
    uid = int(os.environ.pop("VICTIM_UID"))
    os.setgroups([]); os.setgid(uid); os.setuid(uid)

    class Loader:
        num_workers = requested_workers = 1
        max_workers = None
        batch_size = 8
        def __init__(self):
            self.t0 = time.monotonic()
        def resize(self, n):
            self.num_workers = n
        def worker_pids(self):
            return []
        def stats(self):
            up = time.monotonic() - self.t0
            steps = int(up * 20)
            return {"steps": steps, "samples": steps * 8, "batches": steps, "workers": self.num_workers,
                    "data_wait_s": up * 0.3, "compute_s": up * 0.7, "worker_cpu_s": up * 0.5,
                    "worker_wall_s": up, "uptime_s": up}

    loader = Loader()
    client.attach(loader)
    state = sys.argv[1]
    while True:
        with open(state + ".tmp", "w") as f:
            json.dump(client.state(), f)
        os.replace(state + ".tmp", state)
        time.sleep(0.1)
''')


def _env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.pop("ADLOADER_DISABLE", None)
    env.update(extra)
    return env


def _status(endpoint: str) -> tuple[float, dict]:
    from agent import status

    t0 = time.monotonic()
    doc = status.query(endpoint, timeout_s=5.0)
    return time.monotonic() - t0, doc


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def _max_tick_gap(samples: list) -> float:
    """The longest time (s) between two sample times at which the tick counter had moved."""
    moved = [t for (t, n), (_, m) in zip(samples[1:], samples[:-1]) if n != m]
    times = [samples[0][0]] + moved + ([samples[-1][0]] if samples else [])
    return max((b - a for a, b in zip(times, times[1:])), default=0.0)


def run_one(name: str, seconds: float, tick_s: float, agent_repo: Path = REPO, nofile: str = "") -> dict:
    base = tempfile.mkdtemp(prefix="adlsb")
    os.chmod(base, 0o755)
    endpoint = f"ipc://{base}/agent.sock"
    log = open(f"{base}/agent.log", "w")
    wrap = ["prlimit", f"--nofile={nofile}", "--"] if nofile else []
    agent = subprocess.Popen([*wrap, sys.executable, "-m", "agent", "agent", "--endpoint", endpoint, "--state-dir",
                              f"{base}/state", "--cgroup-mode", "off", "--policy", "even", "--tick-s", str(tick_s)],
                             env=_env(PYTHONPATH=str(agent_repo)), stdout=log, stderr=subprocess.STDOUT,
                             cwd=str(agent_repo))
    victim = attacker = None
    try:
        _wait(lambda: os.path.exists(f"{base}/agent.sock") or agent.poll() is not None, 30, "agent socket")
        vdir = f"{base}/victim"
        os.makedirs(vdir)
        os.chmod(vdir, 0o777)
        state = f"{vdir}/state.json"
        victim = subprocess.Popen([sys.executable, "-c", VICTIM_SCRIPT, state], cwd=base, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL,
                                  env=_env(VICTIM_UID=str(VICTIM), ADLOADER_ENDPOINT=endpoint, ADLOADER_JOB_ID="victim",
                                           HOME=vdir))
        _wait(lambda: _read(state).get("welcomes"), 30, "victim welcomed")
        proc = psutil.Process(agent.pid)
        time.sleep(3)
        base_status = [_status(endpoint)[0] for _ in range(5)]
        v0 = _read(state)
        c0 = proc.cpu_times()
        t0 = time.monotonic()
        if SCENARIOS[name] is not None:
            attacker = subprocess.Popen([sys.executable, "-m", "evaluation.attacks", endpoint, str(ATTACKER),
                                         *SCENARIOS[name](seconds)], env=_env(), cwd=str(REPO),
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        status_s, rss, late, ticks = [], [], [], []
        t_end = t0 + seconds
        while time.monotonic() < t_end or (attacker is not None and attacker.poll() is None
                                            and time.monotonic() < t_end + 60):
            if agent.poll() is not None:
                break
            try:
                s, doc = _status(endpoint)
                status_s.append(s)
                ticks.append((time.monotonic(), doc["agent"]["ticks"]))
            except RuntimeError:
                status_s.append(float("inf"))
            try:
                rss.append(proc.memory_info().rss / 2 ** 20)
            except psutil.Error:
                pass
            time.sleep(0.25)
        wall = time.monotonic() - t0
        alive = agent.poll() is None
        cpu = None
        if alive:
            c1 = proc.cpu_times()
            cpu = round(100.0 * ((c1.user + c1.system) - (c0.user + c0.system)) / wall, 1)
        attack = None
        if attacker is not None:
            out, err = attacker.communicate(timeout=120)
            attack = json.loads(out) if attacker.returncode == 0 and out.strip() else {"error": err[-500:]}
        time.sleep(1.5)
        v1 = _read(state)
        reports = v1.get("reports_sent", 0) - v0.get("reports_sent", 0)
        reconnects = v1.get("welcomes", 0) - v0.get("welcomes", 0)
        doc = _status(endpoint)[1] if alive else {}
        gap = _max_tick_gap(ticks) if len(ticks) > 1 else float("inf")
        late = [max(0.0, (gap - tick_s) * 1000.0)]
        finite = [s for s in status_s if s != float("inf")]
        row = {
            "scenario": name, "agent_alive": alive, "attack": attack, "window_s": round(wall, 1),
            "agent_cpu_pct": cpu, "agent_rss_mb_max": round(max(rss), 1) if rss else None,
            "agent_rss_mb_start": round(rss[0], 1) if rss else None,
            "status_s_p50": round(statistics.median(finite), 3) if finite else None,
            "status_s_max": round(max(status_s), 3) if status_s else None,
            "status_s_quiet_p50": round(statistics.median(base_status), 3),
            "tick_late_ms_max": round(max(late), 1) if late else None,
            "victim_reports": reports, "victim_reconnects": reconnects,
            "errors": (doc.get("agent") or {}).get("errors"),
            "jobs": len(doc.get("jobs") or []),
            "victim_cpus": next((j.get("cpus") for j in doc.get("jobs") or [] if j.get("job") == "victim"), None),
            "connections": (doc.get("agent") or {}).get("connections"),
        }
        row["held"] = bool(alive and late and max(late) < 2000 and status_s and max(status_s) < 1.0
                           and reconnects == 0 and reports >= max(1, int(wall) - 3))
        return row
    finally:
        for p in (attacker, victim):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        if agent.poll() is None:
            agent.terminate()
            try:
                agent.wait(20)
            except subprocess.TimeoutExpired:
                agent.kill()
                agent.wait()
        log.close()
        shutil.rmtree(base, ignore_errors=True)


def _rate(row: dict) -> str:
    a = row["attack"] or {}
    if "per_s" in a:
        return f"{a['per_s']}/s"
    if "bytes" in a:
        return f"{a['bytes'] / row['window_s'] / 2 ** 20:.0f} MB/s"
    if "opened" in a:
        return f"{a['opened']} open"
    if "sent" in a:
        return f"{a['sent']} sent"
    return "-"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m evaluation.security_bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=above(finite_float, 0), default=10.0, help="attack window per scenario (default 10)")
    ap.add_argument("--scenarios", type=names_arg, default=",".join(SCENARIOS),
                    help="comma-separated, from: " + ", ".join(SCENARIOS) + " (default all)")
    ap.add_argument("--repeats", type=at_least(plain_int, 1), default=1, help="runs of each scenario, each with a fresh agent (default 1)")
    ap.add_argument("--tick-s", type=above(finite_float, 0), default=1.0, help="the agent's tick (default 1 s, as deployed)")
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    hard = 524288 if hard == resource.RLIM_INFINITY else min(hard, 524288)
    ap.add_argument("--nofile", default=f"1024:{hard}",
                    help="the agent's open-files limit SOFT:HARD (default as systemd gives a service without "
                         f"LimitNOFILE=: soft 1024, hard 524288 or this process's hard limit, here {hard}; "
                         "'' = inherit)")
    ap.add_argument("--agent-repo", type=path_arg, default=str(REPO), help="checkout whose agent to run (default this one)")
    ap.add_argument("--out", type=path_arg, default="bench-out/security_bench.json",
                    help="write the JSON result here (default bench-out/security_bench.json)")
    args = ap.parse_args(argv)
    if os.getuid() != 0:
        print("security_bench: needs root (agent as root, attacker and victim as other uids)", file=sys.stderr)
        return 2
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [n for n in names if n not in SCENARIOS]
    if bad:
        ap.error(f"unknown scenario(s) {bad}; choose from {', '.join(SCENARIOS)}")
    rows = []
    for r in range(args.repeats):
        for name in names:          # interleaved: every scenario once per repeat
            row = run_one(name, args.seconds, args.tick_s, Path(args.agent_repo), args.nofile)
            row["repeat"] = r
            rows.append(row)
            print(f"  {name} (repeat {r + 1}/{args.repeats}): held={row['held']}", file=sys.stderr)
    hdr = ("scenario", "attack", "agent CPU %", "RSS MB (start/max)", "status s p50/max", "tick late ms max",
           "victim reports", "reconnects", "held")
    print(" | ".join(hdr))
    print(" | ".join("---" for _ in hdr))
    for row in rows:
        print(" | ".join(str(x) for x in (
            row["scenario"], _rate(row), row["agent_cpu_pct"],
            f"{row['agent_rss_mb_start']}/{row['agent_rss_mb_max']}",
            f"{row['status_s_p50']}/{row['status_s_max']}", row["tick_late_ms_max"], row["victim_reports"],
            row["victim_reconnects"], row["held"])))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": {"cpus": os.cpu_count(), "load_avg": os.getloadavg()},
                               "seconds": args.seconds, "tick_s": args.tick_s,
                               "agent_repo": args.agent_repo, "nofile": args.nofile, "rows": rows}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
