"""adloader.proctree: the CPU of a process and every process it started, with real processes (a child
that starts a grandchild which burns CPU; both reaped in turn)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from adloader import proctree
from tests.conftest import wait_for

pytestmark = pytest.mark.component

TICKS = 0.03     # /proc counts CPU in clock ticks: a sum of a few of them rounds by a tick each

# The child: starts the grandchild, reaps it when it exits, says so, then waits for its stdin to close.
CHILD = textwrap.dedent("""
    import subprocess, sys
    g = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
    g.wait()
    open(sys.argv[2] + ".reaped", "w").close()
    sys.stdin.read()
""")
# The grandchild: renames itself (a comm with a space and parentheses), burns 0.4 s of CPU, writes its
# pid, and exits once the test says so.
GRANDCHILD = textwrap.dedent("""
    import os, sys, time
    from adloader.synthetic import burn_cpu
    open("/proc/self/comm", "w").write("a) b (c")
    burn_cpu(0.4)
    open(sys.argv[1] + ".tmp", "w").write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    while not os.path.exists(sys.argv[1] + ".go"):
        time.sleep(0.01)
""")


@pytest.fixture(params=["children files", "psutil"])
def way(request, monkeypatch):
    """Both ways to find descendants: the kernel's children files, and psutil where a kernel has none."""
    if request.param == "children files" and not proctree._has_children_files():
        pytest.skip("this kernel has no /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN)")
    monkeypatch.setattr(proctree, "_children_files", request.param == "children files")
    return request.param


def _reaped() -> float:
    t = os.times()
    return t.children_user + t.children_system


def test_the_tree_counts_a_grandchilds_cpu_alive_and_after_each_reaping(tmp_path, way):
    """A grandchild's CPU, counted while it lives (through the child), once the child has reaped it (in
    the child's reaped children's), and once this process has reaped the child (in its own): never
    less than before, and in the end exactly this process's CPU and its reaped children's, not twice."""
    from tests.conftest import repo_env

    others = set(proctree.descendants())        # (what earlier tests left running: a resource tracker)
    mark = str(tmp_path / "grandchild")
    before = proctree.tree_cpu_s()
    child = subprocess.Popen([sys.executable, "-c", CHILD, GRANDCHILD, mark], stdin=subprocess.PIPE, env=repo_env())
    try:
        wait_for(lambda: os.path.exists(mark), 60, what="the grandchild's 0.4 s of CPU")
        grandchild = int(open(mark).read())
        assert [p for p in proctree.descendants() if p not in others] == [child.pid, grandchild]
        assert proctree.descendants(child.pid) == [grandchild]
        assert proctree.process_cpu_s(grandchild) >= 0.4 - TICKS     # (its comm: "a) b (c")
        alive = proctree.tree_cpu_s()
        assert alive - before >= 0.4 - TICKS
        open(mark + ".go", "w").close()          # the grandchild exits; the child reaps it
        wait_for(lambda: os.path.exists(mark + ".reaped"), 30, what="the child reaping the grandchild")
        assert [p for p in proctree.descendants() if p not in others] == [child.pid]
        assert proctree.process_cpu_s(grandchild) is None
        reaped_by_child = proctree.tree_cpu_s()
        assert reaped_by_child >= alive - TICKS
        child.stdin.close()
        assert child.wait(30) == 0               # reaped here: in this process's reaped children's
        assert not set(proctree.descendants()) - others
        low = time.process_time() + _reaped()
        reaped_here = proctree.tree_cpu_s()
        high = time.process_time() + _reaped()
        assert reaped_here >= reaped_by_child - TICKS
        rest = sum(proctree.process_cpu_s(p) or 0.0 for p in others)
        assert low - TICKS <= reaped_here - rest <= high + TICKS     # the grandchild's CPU counted once
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_a_process_that_is_gone_is_none_and_a_tree_without_children_is_this_process():
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    assert proctree.process_cpu_s(p.pid) is None
    assert proctree.descendants(p.pid) == []
    rest = sum(proctree.process_cpu_s(q) or 0.0 for q in proctree.descendants())
    low = time.process_time() + _reaped()
    counted = proctree.tree_cpu_s()
    high = time.process_time() + _reaped()
    assert low - TICKS <= counted - rest <= high + TICKS
