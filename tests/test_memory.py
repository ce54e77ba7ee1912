"""Memory measurement (``adloader.memory``): readers on small fake /proc and cgroup trees (unit), and
the loader's per-worker USS/PSS/growth with real worker processes (component).

Nothing here writes to a real memory cgroup: the fake trees live in ``tmp_path``.
"""
from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from adloader import DataLoader, memory

pytestmark = pytest.mark.component

MiB = 1 << 20


# -- sizes ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("text,expected", [
    ("6GiB", 6 << 30), ("512 MiB", 512 << 20), ("2.5G", 2_500_000_000), ("1048576", 1 << 20),
    ("8gb", 8_000_000_000), (4096, 4096), ("0", 0), ("1KiB", 1024), ("1TiB", 1 << 40),
])
def test_parse_bytes_accepts_bytes_and_units(text, expected):
    assert memory.parse_bytes(text) == expected


@pytest.mark.parametrize("bad", ["", "6 GiBs", "-1G", "lots", "1e3", True, None, float("inf"), -5, "G"])
def test_parse_bytes_refuses_with_the_value_named(bad):
    with pytest.raises(ValueError) as e:
        memory.parse_bytes(bad)
    assert repr(bad) in str(e.value) or str(bad) in str(e.value)


@pytest.mark.parametrize("huge", ["9" * 400, "9" * 5000 + " KiB", "1" + "0" * 309])
def test_parse_bytes_refuses_a_size_beyond_any_float(huge):
    # (before: OverflowError from int(inf): a traceback from `adloader agent` with ADLOADER_LOADER_MEMORY)
    with pytest.raises(ValueError, match="must be a finite number") as e:
        memory.parse_bytes(huge)
    assert len(str(e.value)) < 120


# -- fake /proc -----------------------------------------------------------------------------------

ROLLUP = """55d0-7ffd ---p 00000000 00:00 0  [rollup]
Rss:               20480 kB
Pss:               12288 kB
Shared_Clean:       8192 kB
Shared_Dirty:          0 kB
Private_Clean:      1024 kB
Private_Dirty:      7168 kB
Swap:                512 kB
"""


def test_process_memory_reads_smaps_rollup(tmp_path):
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "smaps_rollup").write_text(ROLLUP)
    m = memory.process_memory(42, str(tmp_path))
    assert (m.rss, m.pss, m.uss, m.swap, m.source) == (20 * MiB, 12 * MiB, 8 * MiB, 512 * 1024, "smaps_rollup")


def test_private_hugetlb_pages_count_as_the_process_s_own(tmp_path):
    """hugetlbfs pages are left out of Rss, Pss and Private_* by the kernel (proc.rst): a worker holding
    64 MiB of them measured 8 MiB before."""
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "smaps_rollup").write_text(ROLLUP + "Shared_Hugetlb:        0 kB\nPrivate_Hugetlb:   65536 kB\n")
    m = memory.process_memory(42, str(tmp_path))
    assert (m.uss, m.pss, m.rss) == (72 * MiB, 76 * MiB, 84 * MiB)


SMAPS = """00400000-00452000 r-xp 00000000 08:02 173521      /usr/bin/python3
Rss:                4096 kB
Pss:                2048 kB
Shared_Clean:       4096 kB
Private_Clean:         0 kB
Private_Dirty:         0 kB
VmFlags: rd ex mr mw me dw
7f00-7f80 rw-p 00000000 00:00 0
Rss:                8192 kB
Pss:                8192 kB
Private_Clean:      1024 kB
Private_Dirty:      7168 kB
Swap:                512 kB
"""


def test_process_memory_falls_back_to_smaps_summed_and_none_when_gone(tmp_path):
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "smaps").write_text(SMAPS)                  # a kernel before 4.14: no smaps_rollup
    m = memory.process_memory(7, str(tmp_path))
    assert (m.rss, m.pss, m.uss, m.swap, m.source) == (12 * MiB, 10 * MiB, 8 * MiB, 512 * 1024, "smaps")
    assert memory.process_memory(8, str(tmp_path)) is None


def test_statm_is_not_taken_for_unique_memory(tmp_path):
    """statm's "shared" is file-backed and shmem pages, not pages shared with other processes: a forked
    worker's inherited copy-on-write pages counted as its own there (404 MiB "unique" for a worker whose
    smaps_rollup said 1.4 MiB). A process whose smaps cannot be read is not measured."""
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "statm").write_text("1000 300 100 1 0 200 0\n")
    assert memory.process_memory(7, str(tmp_path)) is None


def test_a_forked_child_reading_its_parents_array_is_measured_unique_only_from_its_own_pages(tmp_path):
    """A real fork over a 64 MiB array (read, never written): its smaps (the fallback) and smaps_rollup
    both say a few MiB unique, though its RSS holds the array."""
    arr = np.ones(64 * MiB // 8)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:                                                  # the child: read every page, then wait
        os.close(r)
        float(arr[::512].sum())
        os.write(w, b"x")
        import time as _time
        _time.sleep(30)
        os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 1) == b"x"
        (tmp_path / str(pid)).mkdir()
        with open(f"/proc/{pid}/smaps") as f:
            (tmp_path / str(pid) / "smaps").write_text(f.read())
        with open(f"/proc/{pid}/statm") as f:
            (tmp_path / str(pid) / "statm").write_text(f.read())
        fallback = memory.process_memory(pid, str(tmp_path))
        live = memory.process_memory(pid)
    finally:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        os.close(r)
    assert fallback.source == "smaps" and live.source == "smaps_rollup"
    for m in (fallback, live):
        assert m.rss > 64 * MiB and m.uss < 16 * MiB, m
        assert m.pss < m.rss


def test_node_memory_reads_meminfo_and_psi(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal:  24000000 kB\nMemFree: 100 kB\nMemAvailable: 1000000 kB\n")
    (tmp_path / "pressure").mkdir()
    (tmp_path / "pressure" / "memory").write_text(
        "some avg10=12.50 avg60=3.00 avg300=1.00 total=123456\nfull avg10=4.00 avg60=1.00 avg300=0.10 total=99\n")
    n = memory.node_memory(str(tmp_path))
    assert n.total == 24000000 * 1024 and n.available == 1000000 * 1024
    assert (n.some_avg10, n.full_avg10, n.some_total_us) == (12.5, 4.0, 123456)
    empty = memory.node_memory(str(tmp_path / "nothing"))
    assert (empty.total, empty.available, empty.some_avg10) == (None, None, None)


def _cgroup_tree(tmp_path, cgroup_lines: str):
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup_lines)
    (proc / "meminfo").write_text("MemTotal: 16777216 kB\nMemAvailable: 8388608 kB\n")
    return proc, tmp_path / "cg"


def test_cgroup_v1_limit_is_the_least_of_the_group_and_its_ancestors(tmp_path):
    proc, cg = _cgroup_tree(tmp_path, "5:cpu:/\n4:memory:/slurm/job_9/step_0\n")
    for rel, limit in (("", "9223372036854771712"), ("slurm", "9223372036854771712"),
                       ("slurm/job_9", str(2 << 30)), ("slurm/job_9/step_0", str(3 << 30))):
        d = cg / "memory" / rel
        d.mkdir(parents=True, exist_ok=True)
        (d / "memory.limit_in_bytes").write_text(limit + "\n")
        (d / "memory.usage_in_bytes").write_text(str(1 << 30) + "\n")
    got = memory.cgroup_memory("self", str(proc), str(cg))
    assert got.limit == 2 << 30 and got.usage == 1 << 30 and got.path.endswith("slurm/job_9")
    # room: min(MemAvailable 8 GiB, limit - usage = 1 GiB)
    assert memory.memory_room("self", str(proc), str(cg)) == 1 << 30


def test_cgroup_v2_memory_max_and_unlimited(tmp_path):
    proc, cg = _cgroup_tree(tmp_path, "0::/user.slice/job\n")
    (cg / "user.slice" / "job").mkdir(parents=True)
    (cg / "user.slice" / "memory.max").write_text("max\n")
    (cg / "user.slice" / "job" / "memory.max").write_text(f"{512 * MiB}\n")
    (cg / "user.slice" / "job" / "memory.current").write_text(f"{100 * MiB}\n")
    got = memory.cgroup_memory("self", str(proc), str(cg))
    assert (got.limit, got.usage) == (512 * MiB, 100 * MiB)
    (cg / "user.slice" / "job" / "memory.max").write_text("max\n")
    assert memory.cgroup_memory("self", str(proc), str(cg)).limit is None
    assert memory.memory_room("self", str(proc), str(cg)) == 8388608 * 1024      # MemAvailable alone


def test_this_process_limit_is_read_without_writing(tmp_path):
    """On the real machine: reads /proc/self/cgroup and the limit files; no exception, no write."""
    got = memory.cgroup_memory()
    assert got.limit is None or got.limit > 0
    assert memory.memory_room() is None or memory.memory_room() >= 0


def test_batch_nbytes_walks_containers():
    batch = {"x": torch.zeros(4, 8), "y": [torch.zeros(3, dtype=torch.int64), np.zeros(5, dtype=np.uint8)],
             "name": "ab"}
    assert memory.batch_nbytes(batch) == 4 * 8 * 4 + 3 * 8 + 5 + 2


# -- real workers: copy-on-read seen for Python objects, not for arrays ----------------------------

class ObjectRows(torch.utils.data.Dataset):
    """The pattern users report: a list of Python objects (dicts of str/list) built before fork."""

    def __init__(self, n: int) -> None:
        self.rows = [{"id": i, "name": f"sample-{i:08d}", "vals": [float(i), 1.0, 2.0, 3.0]} for i in range(n)]

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return torch.tensor(self.rows[i]["vals"])


class ArrayRows(torch.utils.data.Dataset):
    """The remedy: the same data in one numpy array (no per-object header to write)."""

    def __init__(self, n: int) -> None:
        self.vals = np.tile(np.arange(4, dtype=np.float64), (n, 1))
        self.vals[:, 0] = np.arange(n)

    def __len__(self) -> int:
        return len(self.vals)

    def __getitem__(self, i: int):
        return torch.from_numpy(self.vals[i].copy())


def _run_epoch_and_measure(ds) -> dict:
    dl = DataLoader(ds, batch_size=500, num_workers=2, persistent_workers=True,
                    multiprocessing_context="fork")
    try:
        it = iter(dl)
        next(it)
        dl._core.memory.sample(dl.worker_pids(), force=True)      # each worker's baseline, early
        for _ in it:
            pass
        dl._core.memory.sample(dl.worker_pids(), force=True)
        s = dl.stats()
    finally:
        dl.close()
    return s


def test_worker_memory_growth_seen_for_python_objects_not_for_arrays():
    objs = _run_epoch_and_measure(ObjectRows(200_000))
    arrs = _run_epoch_and_measure(ArrayRows(200_000))
    for s, item_bytes in ((objs, 4), (arrs, 8)):        # float32 tensors from lists; float64 from the array
        assert s["memory_workers"] == 2
        assert s["worker_uss_bytes"] > 0 and s["worker_pss_bytes"] >= s["worker_uss_bytes"]
        assert len(s["memory"]) == 2 and all(v["pss"] > 0 for v in s["memory"].values())
        assert s["batch_bytes"] == 500 * 4 * item_bytes
        assert s["shm_inflight_bytes"] == 2 * 2 * s["batch_bytes"]          # prefetch 2 x 2 workers
    # the object list (~60 MB of dicts) is copied page by page into each worker as it is read
    assert objs["worker_growth_bytes"] > 10 * MiB, objs["worker_growth_bytes"]
    # the array is read without writing: its pages stay shared
    assert arrs["worker_growth_bytes"] < 3 * MiB, arrs["worker_growth_bytes"]
    assert objs["worker_growth_bytes"] > 5 * arrs["worker_growth_bytes"]


def test_sampler_is_rate_limited_and_keeps_a_dead_workers_last_sample():
    sampler = memory.WorkerMemorySampler(every_s=2.0)
    me = os.getpid()
    first = sampler.sample([me], now=100.0)
    assert first.workers == 1 and first.uss > 0
    assert sampler.sample([me], now=100.5) is first            # within every_s: no new read
    parent = os.getppid()
    both = sampler.sample([me, parent], now=100.6)
    assert both.workers == 2                                   # a new worker is sampled at once
    left = sampler.sample([me], now=100.7)                     # a worker that left (retired): gone at once,
    assert left.workers == 1 and set(left.per_worker) == {me}  # from the last samples, nothing re-read
    assert left.uss == both.per_worker[me]["uss"] and left.sampled_at == both.sampled_at
    later = sampler.sample([me], now=103.0)
    assert later is not first and later.per_worker[me]["growth"] == later.uss - first.uss
    assert parent not in sampler._tracks                       # gone from the set: forgotten
    gone = sampler.sample([], now=106.0)
    assert gone.workers == 0 and sampler.last_memory(me) is not None
    sampler.forget_dead([])
    assert sampler.last_memory(me) is None


def test_a_workers_baseline_is_its_first_sample_once_ready(tmp_path):
    """Until a worker is ready (it finished a task) each sample replaces its baseline: the pages a fork
    copies as the worker starts are not growth, however late the scheduler ran the worker's start."""
    def rollup(uss_mib: int) -> None:
        (tmp_path / "7").mkdir(exist_ok=True)
        (tmp_path / "7" / "smaps_rollup").write_text(f"Rss: {uss_mib * 1024 + 4096} kB\nPss: {uss_mib * 1024} kB\n"
                                                     f"Private_Dirty: {uss_mib * 1024} kB\n")

    sampler = memory.WorkerMemorySampler(every_s=2.0, proc_root=str(tmp_path))
    rollup(1)                                                  # just forked
    assert sampler.sample([7], now=10.0, ready=[]).growth_per_worker == 0
    rollup(9)                                                  # started: not growth
    s = sampler.sample([7], now=13.0, ready=[])
    assert s.growth_per_worker == 0 and s.uss == 9 * MiB
    rollup(10)
    assert sampler.sample([7], now=13.1, ready=[7]).growth_per_worker == 0   # ready: sampled at once
    rollup(30)                                                 # reading copies pages: growth
    assert sampler.sample([7], now=13.2, ready=[7]).growth_per_worker == 0   # within every_s: no read
    assert sampler.sample([7], now=16.0, ready=[7]).growth_per_worker == 20 * MiB
    assert sampler.sample([7], now=19.0).growth_per_worker == 20 * MiB        # ready=None: all ready


def test_forked_workers_leave_the_inherited_objects_to_the_permanent_gc_generation():
    """(A worker's first full collection copied every page of torch's objects and the dataset's, ~35
    MiB, at a time its gc counters decided: ``adloader._pool._start_process``.)"""
    import gc

    class FreezeCount(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            return gc.get_freeze_count()

    frozen_before = gc.get_freeze_count()
    dl = DataLoader(FreezeCount(), batch_size=None, num_workers=1, multiprocessing_context="fork")
    try:
        counts = [int(x) for x in dl]
    finally:
        dl.close()
    assert all(c > 1000 for c in counts), counts               # torch alone is many thousands
    assert gc.get_freeze_count() == frozen_before              # the training process is left as it was


def test_a_training_process_that_froze_objects_itself_keeps_them_frozen():
    """The training process's collector is never touched: a process that called ``gc.freeze()`` itself
    keeps its objects frozen (an unfreeze in it would thaw them), and its worker freezes all it inherited."""
    import gc

    class FreezeCount(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 2

        def __getitem__(self, i: int):
            return gc.get_freeze_count()

    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        assert mine > 0
        young = [[i] for i in range(2000)]                         # allocated after the user's freeze
        dl = DataLoader(FreezeCount(), batch_size=None, num_workers=1, multiprocessing_context="fork")
        try:
            counts = [int(x) for x in dl]
        finally:
            dl.close()
        assert all(c > mine + 1000 for c in counts), (counts, mine)   # the worker froze the young lists too
        assert mine // 2 < gc.get_freeze_count() <= mine            # the user's freeze, neither thawed nor grown
        del young
    finally:
        gc.unfreeze()


def test_starting_workers_leaves_the_training_process_s_young_objects_young():
    """A worker is frozen in the child, not by freezing and unfreezing the training process around the
    fork: the unfreeze moved every young object to the oldest generation, so cyclic garbage made just
    before an epoch's workers started waited for a full collection (a young one frees it here)."""
    import gc
    import weakref

    class Node:
        pass

    freed = []
    was = gc.isenabled()
    gc.collect()
    gc.disable()                         # no automatic collection moves the cycle on meanwhile
    try:
        node = Node()
        node.me = node                   # a cycle: only the collector frees it
        weakref.finalize(node, freed.append, True)
        del node
        dl = DataLoader(list(range(4)), batch_size=2, num_workers=1, multiprocessing_context="fork")
        try:
            assert len(list(dl)) == 2
        finally:
            dl.close()
        gc.collect(1)                    # the two young generations only
        assert freed == [True]
    finally:
        if was:
            gc.enable()


def test_stats_document_every_memory_key():
    from adloader.dataloader import DataLoader as DL

    doc = DL.stats.__doc__
    for k in memory.STATS_KEYS + ("memory",):
        assert k in doc, k
    dl = DataLoader(list(range(8)), batch_size=2, num_workers=0)
    s = dl.stats()
    assert set(memory.STATS_KEYS) <= set(s) and s["memory_workers"] == 0 and s["shm_inflight_bytes"] == 0


# -- num_workers="auto" without an agent: the process's own memory bounds its workers -------------

def test_memory_cap_from_stats_room_and_limit():
    from adloader.autotune import MEMORY_RESERVE_MIN, memory_cap

    s = {"memory_workers": 2, "workers": 2, "worker_uss_bytes": 200 * MiB, "shm_inflight_bytes": 0}
    assert memory_cap(s, None, None) is None                      # room unknown: no bound
    assert memory_cap({**s, "memory_workers": 0}, 1 << 30, None) is None   # nothing measured yet
    # 200 MiB held + room 1 GiB - reserve 256 MiB = 968 MiB / 100 MiB per worker -> 9
    assert memory_cap(s, 1 << 30, None) == (200 * MiB + (1 << 30) - MEMORY_RESERVE_MIN) // (100 * MiB)
    # the reserve is 10% of a large limit
    assert memory_cap(s, 1 << 30, 8 << 30) == (200 * MiB + (1 << 30) - (8 << 30) // 10) // (100 * MiB)
    assert memory_cap(s, 0, None) == 1                             # never below one worker


def test_memory_cap_holds_through_noise_tightens_on_a_real_shortage_and_loosens_with_a_margin():
    """MemAvailable (the room) moves with the page cache; the cap a caller last took (``previous``) is
    kept until the figure moves past half the reserve. 2 workers of 100 MiB, limit 10 GiB (reserve
    1 GiB, margin 512 MiB)."""
    from adloader.autotune import memory_cap

    GiB = 1 << 30
    s = {"memory_workers": 2, "workers": 2, "worker_uss_bytes": 200 * MiB, "shm_inflight_bytes": 0}
    room = GiB + 300 * MiB                       # fit = 200 + 1324 - 1024 = 500 MiB: 5 workers
    assert memory_cap(s, room, 10 * GiB) == 5
    for wiggle in (-50, -99, +60, +99, -1, +1):   # +-100 MiB: the band holds 5 (without it: 4, 5 or 6)
        assert memory_cap(s, room + wiggle * MiB, 10 * GiB, previous=5) == 5
        assert memory_cap(s, room + wiggle * MiB, 10 * GiB) in (4, 5, 6)
    # a real shortage: 5 workers would eat into more than half the reserve -> the figure now, at once
    assert memory_cap(s, room - 600 * MiB, 10 * GiB, previous=5) == 1       # fit -100 MiB: at least 1
    assert memory_cap(s, room - 200 * MiB, 10 * GiB, previous=5) == 5       # 300 MiB into the reserve: held
    assert memory_cap(s, room - 520 * MiB, 10 * GiB, previous=5) == 1       # fit -20 MiB, 520 MiB short
    # looser only with the margin to spare: 6 workers need fit >= 600 MiB + 512 MiB
    assert memory_cap(s, room + 600 * MiB, 10 * GiB, previous=5) == 5
    assert memory_cap(s, room + 612 * MiB, 10 * GiB, previous=5) == 6
    assert memory_cap(s, room + 2 * GiB, 10 * GiB, previous=5) == (500 * MiB + 2 * GiB - 512 * MiB) // (100 * MiB)


def test_a_loaders_memory_bound_under_a_moving_memavailable_does_not_churn_the_agents_plan(monkeypatch):
    """The loader's ``memory_bound_workers`` (real workers, their USS measured as 1 GiB each) under a
    MemAvailable that moves +-3% a tick (page cache), reported to the agent's registry and collector,
    planned by ``adaptive`` for 80 ticks: the job's plan is not re-made with the noise. The node's free
    memory is such that 2 workers fit with 0.05 GiB to spare, give or take the noise (room = free less
    what the workers hold: they leave it when retired). Before, the bound went 1, 2, 1, ... with the
    noise and the plan followed it (43 worker changes in 80 ticks); a real shortage (free memory down
    by more than the band, half the 3.2 GiB reserve) still takes a worker at once."""
    import random

    from adloader import autotune
    from agent.collector import Collector
    from agent.controller import Controller
    from agent.policies import PolicyConfig, adaptive
    from agent.registry import Registry
    from agent.security import Peer
    from predictor.bank import PredictorBank
    from tests.test_memory_policy import WorkersFollowDirectives, _report

    GiB = 1 << 30
    limit = 32 * GiB                                # reserve 3.2 GiB
    free = {"bytes": 5.25 * GiB, "reads": 0}        # fit = free - reserve = 2.05 GiB of 1 GiB workers
    rnd = random.Random(7)

    def limits():   # MemAvailable: the node's free memory +-3% (the first reading as it is), less the workers
        free["reads"] += 1
        wiggle = rnd.uniform(-0.03, 0.03) if free["reads"] > 1 else 0.0
        return free["bytes"] * (1 + wiggle) - dl.num_workers * GiB, limit

    dl = DataLoader(list(range(400)), batch_size=4, num_workers=2, max_workers=8)
    monkeypatch.setattr(memory, "process_memory", lambda pid, proc_root="/proc": memory.ProcessMemory(
        pid=pid, rss=GiB, pss=GiB, uss=GiB))
    monkeypatch.setattr(autotune, "memory_limits", limits)
    reg, me = Registry(), os.getpid()
    peer = Peer(os.getuid(), 0, me)
    reg.hello(peer, b"r0", {"job": "j", "rank": 0, "pid": me, "gpus": ["0"], "batch_size": 32, "workers": 2}, 0.0)
    col = Collector(reg, loader_cpus=8.0, cpu_ids=tuple(range(8)))
    act = WorkersFollowDirectives()
    ctl = Controller(snapshot_source=col.snapshot, policy=adaptive, policy_config=PolicyConfig(),
                     predictor=PredictorBank(prior=None), actuators=[act])
    planned = []
    try:
        it = iter(dl)
        next(it)
        for t in range(1, 81):
            if t == 70:
                free["bytes"] -= 2 * GiB            # a real shortage: another tenant took 2 GiB
            n = act.workers.get("j", 2)
            if n != dl.num_workers:
                dl._resize(n, own=False)
            dl._core.memory.sample(dl.worker_pids(), force=True)      # (the sampler's 2 s, in ticks)
            bound = dl.stats()["memory_bound_workers"]
            stats = {**_report(float(t), dl.num_workers, GiB, 10 * t), "memory_bound_workers": bound}
            reg.report(b"r0", peer, {"job": "j", "rank": 0, "pid": me, "worker_pids": [], "stats": stats}, float(t))
            col.on_report("j", 0, me, stats, float(t))
            ctl.tick(float(t))
            planned.append(act.workers.get("j"))
        changes = [t for t, (a, b) in enumerate(zip(planned, planned[1:]), start=2) if a != b]
        assert planned[60] == 2 and planned[-1] == 1, planned
        assert len(changes) <= 2 and changes[-1] >= 70, planned      # the first plan, and the shortage
    finally:
        dl.close()


def test_a_workers_cost_never_falls_below_the_most_seen_though_new_workers_start_small():
    """Real workers reading a list of Python objects copy the objects' pages as they touch them (their
    USS grows over the epoch). Workers started mid-epoch (a resize) and a new epoch's workers
    (``persistent_workers=False``) measure small again at first: the mean cost fell, and with it the
    worker cost that ``memory_bound_workers`` and the agent plan by (measured here: 9 MiB at an epoch's
    start, 31 MiB at its end, 24 -> 20 MiB at the resize), so both allowed workers the node could not
    hold by the epoch's end. The cost (``autotune.worker_cost`` of ``stats()``, and the agent's
    ``JobStats.worker_memory_bytes`` from the same reports) now never falls below the most seen."""
    from adloader import autotune
    from agent.collector import Collector
    from agent.registry import Registry
    from agent.security import Peer

    def raw(s):      # one worker's cost by the workers now: their mean USS plus a share of the batches
        return s["worker_uss_bytes"] / s["memory_workers"] + s["shm_inflight_bytes"] / max(1, s["workers"])

    reg, me = Registry(), os.getpid()
    reg.hello(Peer(os.getuid(), 0, me), b"r0", {"job": "j", "rank": 0, "pid": me, "batch_size": 100}, 0.0)
    col = Collector(reg, loader_cpus=2.0, cpu_ids=(0, 1))
    dl = DataLoader(ObjectRows(200_000), batch_size=100, num_workers=2, max_workers=4, persistent_workers=False,
                    multiprocessing_context="fork")
    dl._core.memory.every_s, dl._core.memory.max_overhead = 0.0, 1.0    # a sample at each stats()
    seen = []        # (epoch, batch, raw cost, the loader's cost, the agent's cost)
    try:
        t = 0.0
        for epoch in range(2):
            for i, _ in enumerate(dl):
                if epoch == 0 and i == 1000:
                    dl.resize(3)                # a worker started mid-epoch: it has copied nothing yet
                if i % 100 == 0 or i in (1001, 1003, 1990) or (epoch == 1 and i < 5):
                    s = dl.stats()
                    if s["memory_workers"]:
                        t += 1.0
                        col.on_report("j", 0, me, dict(s, uptime_s=t), t)
                        job = col.snapshot(t).jobs["j"]
                        seen.append((epoch, i, raw(s), autotune.worker_cost(s), job.worker_memory_bytes))
        costs = [c for _, _, _, c, _ in seen]
        assert all(b >= a for a, b in zip(costs, costs[1:])), seen                 # never falls
        assert [x[4] for x in seen] == pytest.approx(costs), seen                 # the agent's: the same
        most0 = max(r for e, _, r, _, _ in seen if e == 0)
        start1 = [x for x in seen if x[0] == 1][0]
        assert start1[2] < 0.8 * most0, seen          # the new epoch's workers measure small at first ...
        assert start1[3] >= most0                     # ... and are counted at the most seen
        assert dl.stats()["worker_cost_peak_bytes"] == pytest.approx(costs[-1])
    finally:
        dl.close()


def test_tuner_sheds_workers_over_its_memory_cap_and_never_grows_past_it():
    from adloader.autotune import AutoTuner
    from predictor.observation import Observation

    from predictor.bank import PredictorBank

    t = AutoTuner(cpus=8.0, cap=16, current=6, bank=PredictorBank(None))
    assert t.window(None, memory_cap=3) == 3                       # at once, whatever the hysteresis
    starved = dict(workers=3, cores=8.0, batch_size=32, compute_s_per_step=0.1, data_wait_s_per_step=0.4,
                   cpu_s_per_batch=0.5, wall_s_per_batch=0.5, runq_s_per_batch=0.0, blocked_s_per_batch=0.0,
                   samples_per_s=64.0, duration_s=2.0, steps=4)
    moves = [t.window(Observation(**starved), memory_cap=3) for _ in range(6)]
    assert all(m is None for m in moves) and t.current == 3        # data-starved, but memory says 3
    moves = [t.window(Observation(**starved), memory_cap=5) for _ in range(6)]
    assert t.current <= 5 and any(m is not None for m in moves)


def test_auto_loader_respects_a_small_memory_room(monkeypatch):
    """Real workers: with no room left under the process's limit, "auto" sheds to one worker."""
    import time as _time

    from adloader import autotune

    monkeypatch.setattr(autotune, "WINDOW_S", 0.3)
    monkeypatch.setattr(autotune, "memory_limits", lambda: (0, None))        # no room: the cap is 1
    monkeypatch.setattr(autotune, "usable_cpus", lambda *a: 3.0)             # so "auto" starts at 3
    ds = ObjectRows(20_000)
    dl = DataLoader(ds, batch_size=50, num_workers="auto", max_workers=3, persistent_workers=True,
                    multiprocessing_context="fork")
    dl._core.memory.every_s = 0.1
    try:
        start = dl.num_workers
        seen = []
        deadline = _time.monotonic() + 60
        while _time.monotonic() < deadline and (not seen or seen[-1] > 1):
            for i, _ in enumerate(dl):
                if i % 20 == 0:
                    seen.append(dl.num_workers)
                    if seen[-1] == 1 and len(seen) > 3:
                        break
        assert start == 3 and seen[-1] == 1, (start, seen)
        assert autotune.tuner_of(dl).memory_cap == 1
    finally:
        dl.close()


# -- a worker killed by the kernel is reported with its memory and the likely cause ---------------

class Hoarder(torch.utils.data.Dataset):
    """Worker 0's second batch makes it hold ~300 MiB of private memory and wait to be sampled."""

    def __len__(self):
        return 256

    def __getitem__(self, i):
        import time as _time

        info = torch.utils.data.get_worker_info()
        if info is not None and info.id == 0 and i >= 8 and not hasattr(self, "blob"):
            self.blob = bytearray(300 * MiB)          # zero-filled: every page touched
        _time.sleep(0.01)                             # an epoch of a few seconds: the kill lands mid-epoch
        return torch.tensor([i])


def test_a_sigkilled_worker_is_reported_with_its_last_memory_and_the_likely_cause(caplog):
    import logging
    import signal
    import time as _time

    dl = DataLoader(Hoarder(), batch_size=4, num_workers=2, multiprocessing_context="fork")
    sampler = dl._core.memory
    try:
        it = iter(dl)
        got = [next(it) for _ in range(4)]
        victim = None
        deadline = _time.monotonic() + 30
        while victim is None and _time.monotonic() < deadline:
            s = sampler.sample(dl.worker_pids(), force=True)
            victim = next((int(p) for p, v in s.per_worker.items() if v["uss"] > 200 * MiB), None)
            _time.sleep(0.1)
        assert victim is not None, s.per_worker
        with caplog.at_level(logging.WARNING, logger="adloader"):
            os.kill(victim, signal.SIGKILL)                 # what the OOM killer sends
            got += list(it)
        assert [int(x) for b in got for x in b] == list(range(256))       # re-dispatched as today
        text = " ".join(r.getMessage() for r in caplog.records)
        assert f"DataLoader worker (pid {victim}) is killed by signal: Killed." in text
        assert "last measured memory 3" in text and "unique" in text       # ~300 MiB
        assert "likely killed by the kernel's OOM killer (SIGKILL while it held much memory)" in text \
            or "killed by the kernel's OOM killer (SIGKILL; this cgroup's oom_kill count" in text
        assert dl.stats()["last_worker_death"].startswith(f"worker pid {victim}: last measured memory")
    finally:
        dl.close()


# -- an agent's directive: the process's own memory bounds the growth it asks for -----------------

def _fake_memory(monkeypatch, uss: int, room: int, limit: int) -> None:
    """Every worker measured at ``uss`` bytes; ``room`` left under a cgroup ``limit`` (read only)."""
    monkeypatch.setattr(memory, "process_memory", lambda pid, proc_root="/proc": memory.ProcessMemory(
        pid=pid, rss=uss, pss=uss, uss=uss))
    monkeypatch.setattr(memory, "memory_room", lambda *a, **k: room)
    monkeypatch.setattr(memory, "cgroup_memory", lambda *a, **k: memory.CgroupMemory(limit, limit - room, "/x"))
    monkeypatch.setattr(memory, "meminfo", lambda *a, **k: (64 << 30, 32 << 30))


def test_a_directive_grows_workers_only_as_far_as_the_processs_memory_holds(monkeypatch, caplog):
    """A pod's ``limits.memory`` (or Slurm's ConstrainRAMSpace) is invisible to the agent, whose memory
    budget is node-wide: a directive asked for workers the job could not hold, and the OOM killer took
    a worker or the trainer. 2 workers of 1 GiB, 2.5 GiB left under an 8 GiB limit, 0.8 GiB reserve:
    (2 + 2.5 - 0.8) GiB / 1 GiB holds 3 workers."""
    _fake_memory(monkeypatch, uss=1 << 30, room=5 << 29, limit=8 << 30)
    dl = DataLoader(list(range(400)), batch_size=4, num_workers=2, max_workers=8)
    try:
        it = iter(dl)
        for _ in range(8):
            next(it)
        assert dl.stats()["memory_bound_workers"] == 3
        with caplog.at_level("WARNING", logger="adloader"):
            assert dl._resize(6, own=False) == 3                   # clamped to what memory holds
            _fake_memory(monkeypatch, uss=1 << 30, room=3 << 29, limit=8 << 30)   # the third took 1 GiB
            assert dl._resize(7, own=False) == 3                   # again: no second warning
        warned = [r.getMessage() for r in caplog.records if "memory holds" in r.getMessage()]
        assert len(warned) == 1 and "asked for 6 workers" in warned[0] and "keeping 3" in warned[0]
        assert dl.num_workers == 3 and dl.requested_workers == 2
        assert dl._resize(1, own=False) == 1                       # shrinking is the agent's to ask
        assert dl.resize(5) == 5                                   # the job's own count is its own
        _fake_memory(monkeypatch, uss=1 << 30, room=0, limit=8 << 30)
        dl.stats()
        assert dl._resize(8, own=False) == 5                       # no room: never shrunk for it
        assert sorted(sum((b.tolist() for b in it), [])) == list(range(32, 400))
    finally:
        dl.close()


def test_a_directive_to_a_loader_with_no_worker_measured_is_applied(monkeypatch):
    """Before a worker has run there is nothing to measure a worker's cost by: growth is allowed (as
    for ``num_workers="auto"``); the bound applies from the first sample on."""
    _fake_memory(monkeypatch, uss=1 << 30, room=0, limit=8 << 30)
    dl = DataLoader(list(range(40)), batch_size=4, num_workers=0, max_workers=4)
    try:
        assert dl.stats()["memory_bound_workers"] is None
        assert dl._resize(3, own=False) == 3
    finally:
        dl.close()
