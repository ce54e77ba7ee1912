"""Real cgroup v1 hierarchies for the system tier (root only): why a test must skip, and removing a
test's own subtree whatever happened. Test groups live only under ``adloader-test-<pid>[-suffix]``."""
from __future__ import annotations

import os

from agent import cgroupfs

ROOT = "/sys/fs/cgroup"
SUBTREE = f"adloader-test-{os.getpid()}"
# each v1 hierarchy at its mount point (mountinfo: a joined cpu,cpuacct has no "cpu" name), as the agent finds it
CPU = cgroupfs.v1_mount(ROOT, "cpu")
CPUSET = cgroupfs.v1_mount(ROOT, "cpuset")


def skip_reason() -> str | None:
    """Why the v1 system tests cannot run here (None: they can)."""
    if os.geteuid() != 0:
        return "needs root to write cgroups"
    for ctrl in ("cpu", "cpuset"):
        why = cgroupfs.v1_controller_available(ROOT, ctrl)
        if why:
            return why
    return None



def wipe(subtree: str = SUBTREE) -> list[str]:
    """Remove every group under the test subtree (moving its tasks to the root). Returns what was left."""
    left = []
    for ctrl in ("cpu", "cpuset", "blkio"):
        mount = cgroupfs.v1_mount(ROOT, ctrl)
        base = os.path.join(mount, subtree)
        if not os.path.isdir(base):
            continue
        left.append(base)
        dirs = [d for d, _, _ in os.walk(base)]
        for d in sorted(dirs, key=lambda p: -p.count("/")):
            try:
                with open(os.path.join(d, "cgroup.procs")) as f:
                    pids = f.read().split()
                for pid in pids:
                    try:
                        with open(os.path.join(mount, "cgroup.procs"), "w") as f:
                            f.write(pid)
                    except OSError:
                        pass
                os.rmdir(d)
            except OSError:
                pass
    return left

