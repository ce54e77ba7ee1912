"""adloader.DataLoader against torch's DataLoader, with real worker processes (component tier).

Each test runs a few dozen small batches; worker processes are forked unless the test says spawn.
"""
from __future__ import annotations

import contextlib
import logging
import multiprocessing.forkserver
import os
import signal
import threading
import time
import warnings

import psutil
import pytest
import torch
import torch.utils.data as tud

from adloader import DataLoader, memory
from adloader._pool import WorkerPool
from adloader.dataloader import _pin
from adloader.stats import COUNTER_KEYS, GAUGE_KEYS, RATE_KEYS, STATS_KEYS
from tests.conftest import wait_for
from tests.loader_datasets import (Awkward, CpusAtInit, FailsAt, Gated, Indexed, RandomAug, Shards, Slow,
                                    SparseSamples, WhoAmI, collate_dict,
                                    collate_keep_views, collate_tuple, init_fails, init_fails_but_in_worker_0,
                                    init_marks_worker, init_notes_cpus)

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create")]


def _ids(batches) -> list[int]:
    return torch.cat([b.flatten() for b in batches]).tolist()


def _torch_batches(ds, seed=None, **kw):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return [b.clone() if isinstance(b, torch.Tensor) else b for b in tud.DataLoader(ds, generator=gen, **kw)]


@pytest.mark.parametrize("num_workers", [0, 1, 3])
@pytest.mark.parametrize("kw", [dict(batch_size=5, shuffle=True), dict(batch_size=4, drop_last=True, shuffle=True),
                                dict(batch_size=None), dict(batch_size=3, shuffle=False)])
def test_same_batches_as_torch(num_workers, kw):
    ds = Indexed(23)
    ref = _torch_batches(ds, seed=7, **kw)
    got = list(DataLoader(ds, num_workers=num_workers, generator=torch.Generator().manual_seed(7), **kw))
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


def test_global_rng_sampler_matches_torch():
    ds = Indexed(30)
    torch.manual_seed(123)
    ref = _torch_batches(ds, batch_size=4, shuffle=True)
    torch.manual_seed(123)
    got = list(DataLoader(ds, batch_size=4, shuffle=True, num_workers=2))
    assert _ids(got) == _ids(ref)


@pytest.mark.parametrize("iterable", [False, True])
def test_prefetch_window_refills_one_batch_per_batch_taken_like_torch(iterable):
    """torch reads one result per batch taken and sends one index, so its workers get work one batch at
    a time as the training process takes them. Here results that arrived while the caller was busy are
    received when it takes the next batch: the window (dispatched, not yet delivered) never exceeds
    prefetch_factor x workers, and each batch taken dispatches one more. (Before, results were read only
    when no batch was ready, then a whole window went out at once: every worker busy at the same moment,
    which under a CPU quota throttled the job, issue 11.)"""
    import statistics

    ds = Shards(400) if iterable else Indexed(400)
    it = iter(DataLoader(ds, batch_size=2 if not iterable else None, num_workers=2, prefetch_factor=2))
    seq = it._seq
    window, dispatched, prev = [], [], None
    for _ in range(40):
        next(it)
        window.append(seq.issued - seq.delivered_below)
        if prev is not None:
            dispatched.append(seq.issued - prev)
        prev = seq.issued
        time.sleep(0.01)            # the training step: the workers' results arrive meanwhile
    del it
    assert max(window) <= 2 * 2, window
    assert statistics.median(dispatched) == 1, dispatched


def test_resize_mid_epoch_keeps_order_and_reports_target():
    ds = Indexed(120, sleep_s=0.001)
    ref = _ids(_torch_batches(ds, seed=1, batch_size=4, shuffle=True))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(1),
                    num_workers=2, max_workers=6)
    got = []
    for step, b in enumerate(dl):
        got.append(b)
        if step == 3:
            assert dl.resize(5) == 5 and dl.num_workers == 5
            wait_for(lambda: len(dl.worker_pids()) == 5, what="5 workers")
        elif step == 10:
            dl.num_workers = 1            # assignment resizes too
        elif step == 16:
            dl.resize(0)                  # in-process from here
        elif step == 22:
            dl.resize(3)
    assert _ids(got) == ref
    assert dl.resize(99) == 6             # clamped to max_workers
    s = dl.stats()
    assert s["resizes"] == 5 and s["steps"] == 30 and s["samples"] == 120


def test_resize_from_another_thread():
    ds = Indexed(200, sleep_s=0.0005)
    dl = DataLoader(ds, batch_size=2, num_workers=1, max_workers=4)
    stop = threading.Event()

    def flapper():
        n = 0
        while not stop.is_set():
            dl.resize(n % 4 + 1)
            n += 1
            stop.wait(0.005)

    t = threading.Thread(target=flapper)
    t.start()
    try:
        got = _ids(list(dl))
    finally:
        stop.set()
        t.join()
    assert got == list(range(200))


@pytest.mark.parametrize("seed", range(8))
def test_resizes_from_another_thread_keep_torch_order_in_every_configuration(seed):
    """Another thread flaps the worker count every 0-20 ms while the loader runs 1-3 epochs, in a drawn
    configuration (shuffled by a generator or a DistributedSampler with set_epoch, persistent workers or
    not, drop_last, 1-3 workers to start): every epoch's batches equal torch's DataLoader with the same
    arguments (torch's persistent iterator draws its base seed once, so its later epochs' order depends
    on that too). A scratch loop of this ran 1,664 configurations without a difference."""
    import random

    from torch.utils.data.distributed import DistributedSampler

    rng = random.Random(seed)
    n, bs, rank, start = rng.choice([37, 64, 101]), rng.randint(1, 5), rng.randint(0, 1), rng.randint(1, 3)
    persistent, shuffle, drop_last, epochs = rng.random() < 0.5, rng.random() < 0.5, rng.random() < 0.3, rng.randint(1, 3)
    distributed = rng.random() < 0.5

    def kwargs(sampler):
        kw = dict(batch_size=bs, drop_last=drop_last, num_workers=start, persistent_workers=persistent)
        if sampler is not None:
            return dict(kw, sampler=sampler)
        return dict(kw, shuffle=shuffle, generator=torch.Generator().manual_seed(seed))

    samplers = [DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=shuffle, seed=seed)
                if distributed else None for _ in range(2)]
    dl = DataLoader(Indexed(n, sleep_s=rng.choice([0.0003, 0.002])), max_workers=4, **kwargs(samplers[0]))
    ref = tud.DataLoader(Indexed(n), **kwargs(samplers[1]))
    stop = threading.Event()

    def flapper():
        r = random.Random(seed + 1)
        while not stop.is_set():
            dl.resize(r.randint(1, 4))
            stop.wait(0.02 * r.random())

    t = threading.Thread(target=flapper)
    t.start()
    try:
        for epoch in range(epochs):
            for smp in samplers:
                if smp is not None:
                    smp.set_epoch(epoch)
            assert _ids(list(dl)) == _ids(list(ref)), (seed, epoch)
    finally:
        stop.set()
        t.join()
        dl.close()


@pytest.mark.parametrize("seed", range(4))
def test_resizes_and_killed_workers_together_keep_torch_order(seed):
    """One thread flaps the worker count every 0-30 ms while another SIGKILLs a random worker every
    0.15-0.4 s, five at most (a dead worker is replaced and its batches re-run): every epoch equals
    torch's. A scratch
    loop of the same with a kill every 0.05-0.2 s ran 360 configurations without a difference (one gave
    up, as designed, after four workers in a row died before finishing a batch)."""
    import random

    rng = random.Random(seed)
    n, bs, start = rng.choice([137, 264]), rng.randint(1, 5), rng.randint(1, 3)
    kw = dict(batch_size=bs, drop_last=rng.random() < 0.3, num_workers=start,
              persistent_workers=rng.random() < 0.5, shuffle=rng.random() < 0.5)
    epochs = 2
    # torch's batches first, its workers gone before ours fork
    ref = tud.DataLoader(Indexed(n), generator=torch.Generator().manual_seed(seed), **kw)
    want = [_ids(list(ref)) for _ in range(epochs)]
    del ref
    dl = DataLoader(Indexed(n, sleep_s=0.003), max_workers=4, generator=torch.Generator().manual_seed(seed), **kw)
    stop = threading.Event()
    kills = []

    def flapper():
        r = random.Random(seed + 1)
        while not stop.is_set():
            dl.resize(r.randint(1, 4))
            stop.wait(0.03 * r.random())

    def killer():
        r = random.Random(seed + 2)
        while len(kills) < 5 and not stop.wait(0.15 + 0.25 * r.random()):
            pids = dl.worker_pids()
            if pids:
                try:
                    os.kill(r.choice(pids), signal.SIGKILL)
                    kills.append(1)
                except ProcessLookupError:
                    pass

    threads = [threading.Thread(target=flapper), threading.Thread(target=killer)]
    for t in threads:
        t.start()
    try:
        for epoch in range(epochs):
            got = []
            for b in dl:
                got.append(b)
                if len(got) == 1 and epoch == 0:    # at least one kill mid-epoch, however fast the machine
                    wait_for(lambda: bool(kills), what="a worker killed")
            assert _ids(got) == want[epoch], (seed, epoch)
    finally:
        stop.set()
        for t in threads:
            t.join()
        dl.close()
    # (no count of restarts: a worker killed while a resize retires its slot is not replaced)
    assert kills


def test_worker_pids_without_the_retiring_ones():
    """``worker_pids(retiring=False)`` (what the agent client reports) leaves out the workers told to
    retire: each may exit before the agent reads the report. ``worker_pids()`` keeps them until they go."""
    dl = DataLoader(WhoAmI(40, sleep_s=0.3), batch_size=2, num_workers=4, max_workers=4,
                    persistent_workers=True)
    it = iter(dl)
    try:
        next(it)                                  # every worker is busy with a 0.6 s task
        before = dl.worker_pids()
        assert sorted(dl.worker_pids(retiring=False)) == sorted(before) and len(before) == 4
        dl.resize(2)
        taking = dl.worker_pids(retiring=False)
        assert len(taking) == 2 and set(taking) < set(before)
        assert set(taking) <= set(dl.worker_pids())
        wait_for(lambda: len(dl.worker_pids()) == 2, what="the retiring workers gone")
        assert sorted(dl.worker_pids()) == sorted(taking)
    finally:
        dl.close()

def test_shrink_retires_highest_ids_after_their_task():
    dl = DataLoader(WhoAmI(60, sleep_s=0.002), batch_size=2, num_workers=4, max_workers=4,
                    persistent_workers=True)
    it = iter(dl)
    first = [next(it) for _ in range(4)]
    pids_before = dl.worker_pids()
    dl.resize(2)
    rest = list(it)
    ids_late = {w for b in rest[8:] for w in b[1].tolist()}
    assert ids_late <= {0, 1}, ids_late
    wait_for(lambda: len(dl.worker_pids()) == 2, what="two workers left")
    assert set(dl.worker_pids()) <= set(pids_before)
    all_i = [i for b in first + rest for i in b[0].tolist()]
    assert all_i == list(range(60))
    dl.close()


def test_worker_killed_mid_epoch_is_replaced_and_its_batches_redispatched(caplog):
    ds = Indexed(160, sleep_s=0.002)
    dl = DataLoader(ds, batch_size=4, num_workers=3, max_workers=3)
    got = []
    with caplog.at_level(logging.WARNING, logger="adloader"):
        for step, b in enumerate(dl):
            got.append(b)
            if step == 5:
                victim = dl.worker_pids()[1]
                os.kill(victim, signal.SIGKILL)
            if step == 20:
                os.kill(dl.worker_pids()[0], signal.SIGKILL)
    assert _ids(got) == list(range(160))
    s = dl.stats()
    assert s["worker_restarts"] == 2
    assert s["redispatched"] >= 1
    assert any("exited unexpectedly" in r.getMessage() for r in caplog.records)
    assert any("re-dispatched" in r.getMessage() for r in caplog.records)


# ---- the CPU mask a worker runs on (adloader._affinity) -------------------------------------------
# A training script pins itself with os.sched_setaffinity(0, ...), which sets its calling (main) thread's
# mask only; a new process inherits the mask of the thread that forked it (or, forkserver, the fork
# server's). Each test starts a worker from somewhere whose mask is not the main thread's.

def _whole_mask_and_one_cpu() -> tuple[set[int], set[int]]:
    """This process's CPUs, and one of them to pin to (skips where there is only one)."""
    whole = os.sched_getaffinity(0)
    if len(whole) < 2:
        pytest.skip(f"needs 2 CPUs for a worker's mask to differ from its starter's; this process may use "
                    f"{sorted(whole)}")
    return whole, {min(whole)}


@contextlib.contextmanager
def _training_thread_pinned(cpus: set[int]):
    """Pin this, the main, thread to ``cpus`` as a training script does; its mask is put back after."""
    assert threading.current_thread() is threading.main_thread()
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _cpus_at_init(notes, pid: int) -> set[int]:
    """The CPUs worker ``pid`` ran on in its ``worker_init_fn`` (``init_notes_cpus``)."""
    path = notes / f"init-{pid}"
    wait_for(path.exists, what=f"the worker_init_fn of worker {pid}")
    return {int(c) for c in path.read_text().split()}


def test_a_worker_a_users_thread_starts_runs_on_the_training_process_cpu_mask(tmp_path):
    """``loader.resize(2)`` from a thread of the user's own, created before the script pinned itself:
    the worker it starts runs, from before its ``worker_init_fn``, on the main thread's CPU (it was forked
    from that thread, with that thread's whole mask). The worker started before the pin keeps the mask
    it started with, as torch's do."""
    whole, one = _whole_mask_and_one_cpu()
    dl = DataLoader(CpusAtInit(str(tmp_path), 40, sleep_s=0.002), batch_size=2, num_workers=1, max_workers=2,
                    worker_init_fn=init_notes_cpus)
    go = threading.Event()
    user = threading.Thread(target=lambda: go.wait() and dl.resize(2))    # the whole mask
    user.start()
    try:
        it = iter(dl)
        got = [next(it)]
        old, = dl.worker_pids()
        with _training_thread_pinned(one):
            go.set()
            user.join()
            new, = wait_for(lambda: [p for p in dl.worker_pids() if p != old], what="the worker resize(2) started")
            assert os.sched_getaffinity(new) == one
            assert _cpus_at_init(tmp_path, new) == one
            assert os.sched_getaffinity(old) == whole
            got.extend(it)
        assert _ids(got) == list(range(40))
    finally:
        go.set()
        user.join()
        dl.close()


def test_max_workers_defaults_from_the_training_process_cpu_mask_in_any_thread():
    """A loader built in a thread created before the script pinned its main thread to one CPU: its
    default ``max_workers`` (one per CPU) counts the main thread's mask, 1, not the building thread's
    own, which still holds every CPU."""
    whole, one = _whole_mask_and_one_cpu()
    go, built = threading.Event(), []
    builder = threading.Thread(target=lambda: go.wait() and built.append(
        DataLoader(list(range(8)), batch_size=2, num_workers=0)))
    builder.start()
    try:
        with _training_thread_pinned(one):
            go.set()
            builder.join()
        dl, = built
        assert dl.max_workers == 1
        with _training_thread_pinned(one):
            assert DataLoader(list(range(8)), batch_size=2, num_workers=0).max_workers == 1
        assert DataLoader(list(range(8)), batch_size=2, num_workers=0).max_workers == len(whole)
    finally:
        go.set()
        builder.join()


def test_a_replacement_worker_runs_on_the_training_process_cpu_mask(tmp_path):
    """A worker killed mid-epoch is replaced by whichever thread handles its death: the one iterating
    the loader (here a thread created before the pin, with the whole mask) or the pool's reaper. The
    replacement runs on the main thread's CPU, from before its ``worker_init_fn``, and the epoch is whole."""
    _, one = _whole_mask_and_one_cpu()
    dl = DataLoader(CpusAtInit(str(tmp_path), 40, sleep_s=0.002), batch_size=2, num_workers=2, max_workers=2,
                    worker_init_fn=init_notes_cpus)
    ready, pinned = threading.Event(), threading.Event()
    seen: dict = {}

    def gone(pid: int) -> bool:
        try:
            return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return True

    def train() -> None:
        try:
            it = iter(dl)
            got = [next(it)]
            before = dl.worker_pids()
            ready.set()
            pinned.wait()
            os.kill(before[1], signal.SIGKILL)
            wait_for(lambda: gone(before[1]), what="the killed worker's exit")
            got.append(next(it))            # this thread's poll sees the death and starts the replacement
            seen["new"] = new = [p for p in dl.worker_pids() if p not in before]
            seen["masks"] = [os.sched_getaffinity(p) for p in new]
            got.extend(it)
            seen["ids"] = _ids(got)
        except BaseException as e:          # noqa: BLE001 — raised in the test's thread below
            seen["error"] = e
        finally:
            ready.set()

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        ready.wait()
        with _training_thread_pinned(one):
            pinned.set()
            trainer.join()
        if "error" in seen:
            raise seen["error"]
        assert len(seen["new"]) == 1 and seen["masks"] == [one]
        assert _cpus_at_init(tmp_path, seen["new"][0]) == one
        assert seen["ids"] == list(range(40))
        assert dl.stats()["worker_restarts"] == 1
    finally:
        pinned.set()
        trainer.join()
        dl.close()


@pytest.mark.parametrize("by", ["pool", "worker"])
def test_a_forkserver_worker_runs_on_the_training_process_cpu_mask(tmp_path, monkeypatch, by):
    """With ``multiprocessing_context="forkserver"`` every worker is forked by the fork server and
    inherits its mask (here the whole one: the server started before the pin), whichever thread asked.
    The pool sets the main thread's mask on it (``by="pool"``); where the pool's call is left out (a worker
    that ran ahead of it, or a call that failed: ``by="worker"``), the worker sets it on itself, before
    its ``worker_init_fn``."""
    _, one = _whole_mask_and_one_cpu()
    multiprocessing.forkserver.ensure_running()     # with this thread's whole mask
    if by == "worker":
        monkeypatch.setattr(WorkerPool, "_give_cpu_mask", lambda self, wid, pid, mask: None)
    dl = DataLoader(CpusAtInit(str(tmp_path), 8), batch_size=2, num_workers=1, multiprocessing_context="forkserver",
                    worker_init_fn=init_notes_cpus)
    try:
        with _training_thread_pinned(one):
            it = iter(dl)
            got = [next(it)]
            pid, = dl.worker_pids()
            assert os.sched_getaffinity(pid) == one
            assert _cpus_at_init(tmp_path, pid) == one
            got.extend(it)
        assert _ids(got) == list(range(8))
    finally:
        dl.close()


def test_a_mask_set_on_a_started_worker_is_not_undone_by_the_worker(tmp_path):
    """The node agent (cooperative mode) sets the CPU mask of a worker it learns of from the client's
    report, once the pool has published its pid. The pool gives a worker the training process's mask
    before that (so the agent records that mask as the one to put back), and the worker, which with
    forkserver or spawn reaches its own code only after imports and unpickling, then leaves its mask
    alone: what was set on it in the meantime stays."""
    whole, one = _whole_mask_and_one_cpu()
    multiprocessing.forkserver.ensure_running()
    dl = DataLoader(CpusAtInit(str(tmp_path), 8), batch_size=2, num_workers=1, multiprocessing_context="forkserver",
                    worker_init_fn=init_notes_cpus)
    try:
        with _training_thread_pinned(one):
            it = iter(dl)                           # starts the worker
            pid, = dl.worker_pids()
            assert os.sched_getaffinity(pid) == one
            other = {max(whole)}
            os.sched_setaffinity(pid, other)        # what the agent does
            got = [next(it)]
            _cpus_at_init(tmp_path, pid)            # (its worker_init_fn ran)
            assert os.sched_getaffinity(pid) == other
            got.extend(it)
        assert _ids(got) == list(range(8))
    finally:
        dl.close()


def test_dataset_exception_keeps_original_traceback():
    dl = DataLoader(FailsAt(20, bad=7), batch_size=2, num_workers=2)
    it = iter(dl)
    assert next(it).tolist() == [0, 1]
    with pytest.raises(ValueError) as exc:
        list(it)
    msg = str(exc.value)
    assert "Caught ValueError in DataLoader worker process" in msg
    assert "Original Traceback" in msg
    assert 'raise ValueError(f"sample {i} is corrupt")' in msg
    assert "sample 7 is corrupt" in msg


def test_iteration_continues_after_a_dataset_exception_like_torch():
    dl = DataLoader(FailsAt(12, bad=3), batch_size=2, num_workers=2)
    it = iter(dl)
    out = []
    errors = 0
    while True:
        try:
            out.append(next(it).tolist())
        except ValueError:
            errors += 1
        except StopIteration:
            break
    assert errors == 1 and out == [[0, 1], [4, 5], [6, 7], [8, 9], [10, 11]]


def test_num_workers_0_raises_the_exception_itself():
    with pytest.raises(ValueError, match="sample 7 is corrupt"):
        list(DataLoader(FailsAt(20, bad=7), batch_size=2))


def test_pin_memory_without_accelerator_warns_like_torch_and_returns_batches():
    assert not torch.accelerator.is_available()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        got = list(DataLoader(Indexed(10), batch_size=4, num_workers=1, pin_memory=True))
    assert any("no accelerator is found" in str(x.message) for x in w)
    assert _ids(got) == list(range(10))


def test_pin_helper_walks_containers_and_custom_types():
    class Batch:
        def __init__(self):
            self.pinned = False

        def pin_memory(self):
            self.pinned = True
            return self

    out = _pin({"a": [Batch(), (Batch(), "s")], "b": Batch()})
    assert out["b"].pinned and out["a"][0].pinned and out["a"][1][0].pinned and out["a"][1][1] == "s"


@pytest.mark.parametrize("num_workers", [0, 2])
def test_custom_collate_dicts_and_tuples(num_workers):
    got = list(DataLoader(Indexed(9), batch_size=4, num_workers=num_workers, collate_fn=collate_dict))
    assert [g["n"] for g in got] == [4, 4, 1]
    assert torch.cat([g["x"].flatten() for g in got]).tolist() == list(range(9))
    got = list(DataLoader(Indexed(9), batch_size=4, num_workers=num_workers, collate_fn=collate_tuple))
    assert got[0] == ((0, 1, 2, 3), "meta") and got[2] == ((8,), "meta")


@pytest.mark.parametrize("num_workers", [0, 2])
def test_sparse_tensor_batches_arrive_like_torch_s(num_workers):
    # the loader measures a delivered batch's size now and then (stats' batch_bytes); a sparse tensor's
    # nbytes raises, and that must not reach the training loop
    def dense(batches):
        return [(b["m"].to_dense().tolist(), b["i"].tolist()) for b in batches]

    ref = dense(tud.DataLoader(SparseSamples(), batch_size=None, num_workers=num_workers))
    dl = DataLoader(SparseSamples(), batch_size=None, num_workers=num_workers, max_workers=2)
    assert dense(dl) == ref and dl.stats()["steps"] == 4


@pytest.mark.parametrize("num_workers", [0, 2, 3])
@pytest.mark.parametrize("drop_last", [False, True])
def test_iterable_dataset_same_as_torch_for_same_worker_count(num_workers, drop_last):
    ref = [b.tolist() for b in tud.DataLoader(Shards(23), batch_size=3, num_workers=num_workers, drop_last=drop_last)]
    got = [b.tolist() for b in DataLoader(Shards(23), batch_size=3, num_workers=num_workers, drop_last=drop_last)]
    assert got == ref


def test_iterable_resize_waits_for_next_epoch_and_says_so():
    dl = DataLoader(Shards(40), batch_size=2, num_workers=2, max_workers=4, persistent_workers=True)
    it = iter(dl)
    first = [next(it) for _ in range(3)]
    with pytest.warns(UserWarning, match="next epoch"):
        dl.resize(3)
    rest = list(it)
    epoch1 = torch.cat(first + rest)
    assert sorted(epoch1[:, 0].tolist()) == list(range(40))
    assert set(epoch1[:, 1].tolist()) == {2}          # every sample was sharded 2 ways
    epoch2 = torch.cat(list(dl))
    assert sorted(epoch2[:, 0].tolist()) == list(range(40))
    assert set(epoch2[:, 1].tolist()) == {3}
    dl.close()


def test_a_persistent_iterable_loader_resized_between_epochs_reruns_worker_init_fn_for_the_new_count():
    """torch's docs shard an IterableDataset in ``worker_init_fn`` by ``get_worker_info().num_workers``
    (``Span``/``split_span``). A persistent loader resized between epochs kept the workers whose
    ``worker_init_fn`` had cut their copies for the old count: at 3 workers after 2, samples 12-21 came
    twice; after 3 -> 1, only the first third came. Each epoch must equal torch's for the epoch's
    worker count, whatever the resizes before it (mid-epoch ones included)."""
    from tests.loader_datasets import Span, split_span
    dl = DataLoader(Span(23), batch_size=3, num_workers=2, max_workers=4, persistent_workers=True,
                    worker_init_fn=split_span)
    try:
        for workers, resize_to in ((2, 3), (3, 1), (1, 3), (3, 0), (0, 2), (2, None)):
            ref = [b.tolist() for b in tud.DataLoader(Span(23), batch_size=3, num_workers=workers,
                                                       worker_init_fn=split_span if workers else None)]
            got = []
            for b in dl:
                got.append(b.tolist())
                if len(got) == 2 and resize_to is not None:
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")     # "takes effect at the next epoch"
                        dl.resize(resize_to)
            assert got == ref, f"epoch with {workers} workers"
    finally:
        dl.close()


@pytest.mark.parametrize("workers", [0, 1])
def test_an_iterable_loader_built_with_0_or_1_workers_is_never_given_more(workers, caplog):
    """A dataset that does not shard by get_worker_info() yields itself whole in every worker: a loader
    over it with num_workers 0 or 1 that an agent's directive or the user's resize(3) took to 3 workers
    at the next epoch handed out every sample three times (60 of 20). Its max_workers is that count, so
    neither can; a resize of its own says why (a warning naming max_workers); with max_workers passed,
    the user allows more (and the copies are the dataset's own doing, as in torch)."""
    from tests.loader_datasets import Whole
    dl = DataLoader(Whole(20), batch_size=5, num_workers=workers)
    assert dl.max_workers == workers
    assert sorted(int(x) for b in dl for x in b) == list(range(20))
    dl._resize(3, own=False)                        # the agent client's directive
    with caplog.at_level(logging.WARNING, logger="adloader"):
        assert dl.resize(3) == workers
    assert "pass max_workers" in caplog.text
    assert sorted(int(x) for b in dl for x in b) == list(range(20))
    dl.close()
    allowed = DataLoader(Whole(20), batch_size=5, num_workers=workers, max_workers=2)
    assert allowed.resize(2) == 2 and len([x for b in allowed for x in b]) == 40
    allowed.close()
    assert DataLoader(Shards(20), batch_size=5, num_workers=2).max_workers >= 2   # a user's 2: it shards


def test_an_iterable_loader_with_auto_workers_runs_one_unless_max_workers_allows_more():
    """"auto" over an IterableDataset: the autotuner starts and grows workers that would each yield a
    dataset that does not shard whole; it runs one unless the user passes max_workers."""
    from tests.loader_datasets import Whole
    dl = DataLoader(Whole(20), batch_size=5, num_workers="auto")
    assert dl.max_workers == 1 and dl.num_workers <= 1
    assert sorted(int(x) for b in dl for x in b) == list(range(20))
    dl.close()
    assert DataLoader(Whole(20), batch_size=5, num_workers="auto", max_workers=3).max_workers == 3


def test_iterable_resize_warning_made_an_error_comes_after_the_resize_is_done():
    """Under ``python -W error`` the mid-epoch warning of an IterableDataset's resize raised from inside
    ``resize``, before the idle persistent workers of a loader sharing its state were resized (here they
    stayed at 1). The warning comes once the resize is done: a caller that catches it (autotune, the
    agent client) has resized all the same."""
    dl = DataLoader(Shards(40), batch_size=2, num_workers=1, max_workers=3, persistent_workers=True)
    copy = DataLoader(Shards(40), batch_size=2, num_workers=1, persistent_workers=True,
                      elastic_state=dl.elastic_state)
    try:
        assert len(list(copy)) == 20                    # its persistent worker waits between epochs
        it = iter(dl)
        next(it)
        before = len(dl.worker_pids(retiring=False))    # the state's pools: dl's epoch and copy's idle one
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(UserWarning, match="next epoch"):
                dl.resize(2)
        assert dl.num_workers == 2 and len(dl.worker_pids(retiring=False)) == before + 1
        rest = list(it)
        assert set(torch.cat(rest)[:, 1].tolist()) == {1}    # this epoch keeps its shards
    finally:
        copy.close()
        dl.close()


def test_get_worker_info_and_worker_init_fn():
    dl = DataLoader(WhoAmI(30, sleep_s=0.001), batch_size=3, num_workers=3, max_workers=5,
                    worker_init_fn=init_marks_worker)
    rows = []
    for step, (i, wid, nw, pid, mark) in enumerate(dl):
        rows += list(zip(i.tolist(), wid.tolist(), nw.tolist(), pid.tolist(), mark))
        if step == 2:
            dl.resize(5)
    assert [r[0] for r in rows] == list(range(30))
    for _, wid, nw, pid, mark in rows:
        assert 0 <= wid < 5 and nw in (3, 5) and mark == f"init-{wid}" and pid != os.getpid()
    assert os.environ.get("ADLOADER_TEST_INIT") is None
    main = list(DataLoader(WhoAmI(3), batch_size=None))
    assert [m[1] for m in main] == [-1, -1, -1]        # get_worker_info() is None in the main process


def _stop_torch_iter(it) -> None:
    """Stop the workers of torch's iterator ``it`` now. An iterator that raised a worker's error is held
    in a reference cycle, and when the garbage collector frees it, in whichever later test, its
    shutdown waited 5 s per worker (torch 2.13, measured: 15 s for 3 workers, in a script without
    adloader); its own ``_shutdown_workers``, called here, takes milliseconds."""
    it._shutdown_workers()


def test_worker_init_fn_error_reaches_caller_at_the_first_next_as_torch_raises_it():
    """A ``worker_init_fn`` that raises: checked against torch 2.13, and the loader already did what
    torch does. ``iter()`` does not raise; the first ``next()`` raises the init function's exception
    type with torch's text ("Caught OSError in DataLoader worker process 0.", "Original Traceback",
    the worker's frames down to the ``raise``, the error's own line), for a map-style dataset and an
    IterableDataset alike. Where the two differ, after that: torch's iterator goes on (a healthy
    worker's batches, the failed worker's next batch raising torch's own UnboundLocalError, its
    samples never delivered), this loader ends the epoch: the next ``next()`` raises StopIteration; a
    new ``iter()`` starts workers again (persistent workers: see the test below). Several workers:
    the test after this one."""
    def first_error(cls, ds):
        it = iter(cls(ds, batch_size=2, num_workers=1, worker_init_fn=init_fails))
        with pytest.raises(OSError) as exc:
            next(it)
        lines = str(exc.value).strip().splitlines()
        del exc                                     # (its traceback holds the iterator)
        return it, lines

    torch_it, theirs = first_error(tud.DataLoader, Indexed(8))
    _stop_torch_iter(torch_it)
    assert theirs[:2] == ["Caught OSError in DataLoader worker process 0.", "Original Traceback (most recent call last):"]
    assert theirs[-1] == "OSError: worker_init_fn refuses in worker 0"
    for ds in (Indexed(8), Shards(8)):
        it, ours = first_error(DataLoader, ds)
        assert ours[:2] == theirs[:2] and ours[-1] == theirs[-1], ours
        assert '    raise OSError(f"worker_init_fn refuses in worker {worker_id}")' in ours
        with pytest.raises(StopIteration):
            next(it)


def _outcomes(it, n: int) -> list:
    """What ``n`` calls of ``next(it)`` give: a batch's values, an error's type and first line, or
    "StopIteration" (the last)."""
    out: list = []
    for _ in range(n):
        try:
            out.append(next(it).flatten().tolist())
        except StopIteration:
            out.append("StopIteration")
            break
        except Exception as e:      # noqa: BLE001 — what it was is the outcome
            out.append(f"{type(e).__name__}: {str(e).splitlines()[0]}")
    return out


def _open_when_read(dl, failed: int, gate) -> threading.Thread:
    """A thread that creates ``gate`` once the pool of ``dl``'s epoch (started: after ``iter()``) has
    read ``failed`` workers' init errors (they are then told to exit and leave ``worker_pids()``), so no
    batch is made before they are read."""
    def run():
        try:
            wait_for(lambda: len(dl.worker_pids()) <= dl.num_workers - failed, what="the init errors read")
        finally:
            gate.touch()
    opener = threading.Thread(target=run)
    opener.start()
    return opener


@pytest.mark.parametrize("iterable", [False, True])
def test_init_errors_of_several_workers_come_at_the_first_failed_workers_batch_in_order_as_torch(tmp_path, iterable):
    """torch 2.13 hands worker ``w`` the epoch's batch ``w`` first and, when that worker's
    ``worker_init_fn`` raised, raises the error in that batch's place, in order: the batches before it
    come first and the worker named is the failed one whose batch comes first. Three workers, 1 and 2
    failing: batch 0, then worker 1's error, in both loaders (this loader used to raise an init error as
    soon as it read one, and of several the last read). Then torch goes on (worker 2's error, batch 2,
    UnboundLocalError for the failed workers' later batches); this loader ends the epoch. Map-style,
    batches wait until the loader has read both errors (a gate): its workers share one queue, and an
    error read only after a healthy worker made its batch comes at the next batch instead."""
    gate = tmp_path / "gate"
    ds = Shards(12) if iterable else Gated(str(gate), 12)

    def loader(cls):
        return cls(ds, batch_size=2, num_workers=3, worker_init_fn=init_fails_but_in_worker_0)

    gate.touch()
    torch_it = iter(loader(tud.DataLoader))
    theirs = _outcomes(torch_it, 2)
    _stop_torch_iter(torch_it)
    assert theirs[1] == "OSError: Caught OSError in DataLoader worker process 1.", theirs
    gate.unlink()
    dl = loader(DataLoader)
    it = iter(dl)
    opener = _open_when_read(dl, 2, gate) if not iterable else None    # (shards: batch 1 is worker 1's)
    try:
        assert _outcomes(it, 3) == theirs + ["StopIteration"]
    finally:
        if opener is not None:
            opener.join()
        dl.close()


@pytest.mark.parametrize("iterable", [False, True])
def test_when_every_workers_init_fails_worker_0_is_named_as_torch(iterable):
    """Every worker's ``worker_init_fn`` raises: worker 0's error at the first ``next()``, whichever
    failure this loader reads first (batch 0 is worker 0's turn), then the epoch ends."""
    ds = Shards(12) if iterable else Indexed(12)
    torch_it = iter(tud.DataLoader(ds, batch_size=2, num_workers=3, worker_init_fn=init_fails))
    theirs = _outcomes(torch_it, 1)
    _stop_torch_iter(torch_it)
    assert theirs == ["OSError: Caught OSError in DataLoader worker process 0."]
    it = iter(DataLoader(ds, batch_size=2, num_workers=3, worker_init_fn=init_fails))
    assert _outcomes(it, 2) == theirs + ["StopIteration"]


def test_an_init_error_out_of_order_comes_as_it_is_read_and_a_persistent_pool_keeps_it(tmp_path):
    """``in_order=False``: torch raises a worker's init error when it arrives, and so does this loader
    (here before any batch: they wait for the error to be read). A persistent pool keeps the failure:
    no worker is started in its place, and each later epoch raises it again at its batch (worker 1's:
    batch 1, after batch 0); torch's persistent failed worker runs later epochs' batches without its
    ``worker_init_fn`` having run."""
    gate = tmp_path / "gate"
    for in_order in (False, True):
        gate.unlink(missing_ok=True)
        dl = DataLoader(Gated(str(gate), 8), batch_size=2, num_workers=2, worker_init_fn=init_fails_but_in_worker_0,
                        persistent_workers=True, in_order=in_order)
        it = iter(dl)
        opener = _open_when_read(dl, 1, gate)
        try:
            first = _outcomes(it, 3)
            opener.join()
            err = "OSError: Caught OSError in DataLoader worker process 1."
            assert first == ([err, "StopIteration"] if not in_order else [[0, 1], err, "StopIteration"]), first
            if in_order:
                assert _outcomes(iter(dl), 3) == [[0, 1], err, "StopIteration"]
                assert len(dl.worker_pids()) == 1
        finally:
            opener.join()
            dl.close()


def test_an_init_error_waiting_for_its_batch_is_raised_when_no_worker_is_left_to_make_the_ones_before():
    """Worker 1's init error waits for batch 1, after batch 0; when worker 0, the only one left, dies
    first (no worker is started once an init failed), nothing would ever make batch 0: the error is
    raised then, instead of the ``next()`` waiting for good (here: for its ``timeout``)."""
    gate = "/nonexistent/never"                     # batch 0 is never made
    dl = DataLoader(Gated(gate, 8), batch_size=2, num_workers=2, worker_init_fn=init_fails_but_in_worker_0,
                    timeout=30)
    it = iter(dl)
    healthy = dl.worker_pids()[0]

    def kill_when_read():
        wait_for(lambda: len(dl.worker_pids()) <= 1, what="worker 1's init error read")
        os.kill(healthy, signal.SIGKILL)

    killer = threading.Thread(target=kill_when_read)
    killer.start()
    try:
        assert _outcomes(it, 2) == ["OSError: Caught OSError in DataLoader worker process 1.", "StopIteration"]
    finally:
        killer.join()
        dl.close()


def test_timeout():
    dl = DataLoader(Slow(), batch_size=1, num_workers=1, timeout=0.3)
    with pytest.raises(RuntimeError, match="DataLoader timed out after 0.3 seconds"):
        next(iter(dl))


@pytest.mark.parametrize("before,after", [(3, 1), (1, 4), (2, 0), (0, 2)])
def test_state_dict_resume_with_other_worker_count(before, after):
    ds = Indexed(50, sleep_s=0.0005)
    ref = _ids(_torch_batches(ds, seed=5, batch_size=4, shuffle=True))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(5),
                    num_workers=before, max_workers=4)
    it = iter(dl)
    head = [next(it) for _ in range(6)]
    state = dl.state_dict()
    del it
    # a fresh process would have a fresh generator: resume must not depend on it
    dl2 = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(999),
                     num_workers=after, max_workers=4)
    dl2.load_state_dict(state)
    tail = list(dl2)
    assert _ids(head) + _ids(tail) == ref
    # and the next epoch is the one torch would produce next
    gen = torch.Generator().manual_seed(5)
    tl = tud.DataLoader(ds, batch_size=4, shuffle=True, generator=gen)
    list(tl)
    assert _ids(list(dl2)) == _ids(list(tl))


def test_state_dict_resume_global_rng_leaves_callers_rng_alone():
    ds = Indexed(40)
    torch.manual_seed(3)
    ref = _ids(_torch_batches(ds, batch_size=4, shuffle=True))
    torch.manual_seed(3)
    dl = DataLoader(ds, batch_size=4, shuffle=True, num_workers=2)
    it = iter(dl)
    head = [next(it) for _ in range(4)]
    state = dl.state_dict()
    del it
    torch.manual_seed(42)
    expected_next = torch.rand(1)
    torch.manual_seed(42)
    dl2 = DataLoader(ds, batch_size=4, shuffle=True, num_workers=1)
    dl2.load_state_dict(state)
    tail = list(dl2)
    assert _ids(head) + _ids(tail) == ref
    assert torch.equal(torch.rand(1), expected_next)


def test_state_dict_of_an_iterable_mid_epoch_restarts_that_epoch_with_a_warning():
    # Lightning saves the state of every loader with state_dict/load_state_dict in its checkpoints and
    # loads it when a run resumes (CombinedLoader._load_state_dicts): a run resumed from a mid-epoch
    # checkpoint (every_n_train_steps, a requeued Slurm job) crashed on a ValueError here, where with
    # torch's DataLoader it starts the epoch again. The shards cannot be replayed to a position, so the
    # epoch restarts from its beginning, with the same seeds, and a warning says so.
    dl = DataLoader(Shards(20), batch_size=2, num_workers=2, generator=torch.Generator().manual_seed(4))
    it = iter(dl)
    first = [next(it).tolist() for _ in range(3)]
    state = dl.state_dict()
    epoch = first + [b.tolist() for b in it]
    assert sorted(x for b in epoch for x, _ in b) == list(range(20))
    again = DataLoader(Shards(20), batch_size=2, num_workers=2, generator=torch.Generator().manual_seed(99))
    with pytest.warns(UserWarning, match="restarts from its beginning"):
        again.load_state_dict(state)
    assert [b.tolist() for b in again] == epoch and again.stats()["epoch"] == state["epoch"]


@pytest.mark.parametrize("version", [True, 1.0, "1", None, 2])
def test_load_state_dict_refuses_a_version_other_than_the_integer_naming_the_key(version):
    # Python's == took True and 1.0 for version 1
    dl = DataLoader(Indexed(8), batch_size=2)
    state = dl.state_dict()
    assert state["version"] == 1 and type(state["version"]) is int
    dl.load_state_dict(state)
    state["version"] = version
    with pytest.raises(ValueError, match=r"'version' is .*the integer 1 expected"):
        DataLoader(Indexed(8), batch_size=2).load_state_dict(state)
    with pytest.raises(ValueError, match="not an adloader.DataLoader state"):
        DataLoader(Indexed(8), batch_size=2).load_state_dict([state])


def test_random_augmentation_does_not_depend_on_workers():
    def run(nw, resize_at=None):
        dl = DataLoader(RandomAug(40), batch_size=4, shuffle=True,
                        generator=torch.Generator().manual_seed(11), num_workers=nw, max_workers=4)
        out = []
        for step, b in enumerate(dl):
            out.append(b)
            if resize_at is not None and step == resize_at:
                dl.resize(4)
        return [(b["i"].tolist(), b["torch"].tolist(), b["py"].tolist(), b["np"].tolist()) for b in out]

    torch.manual_seed(0)
    before = torch.rand(3)
    base = run(0)
    torch.manual_seed(0)
    assert torch.equal(torch.rand(3), before)      # num_workers=0 left the caller's RNG alone
    assert run(1) == base
    assert run(3) == base
    assert run(2, resize_at=2) == base
    assert len({x for b in base for x in b[1]}) == 40   # really random, not constant


def test_in_order_false_delivers_everything_once():
    got = _ids(list(DataLoader(Indexed(80, sleep_s=0.0005), batch_size=4, num_workers=3, in_order=False)))
    assert sorted(got) == list(range(80))


def test_persistent_workers_keep_processes_across_epochs():
    dl = DataLoader(Indexed(40), batch_size=4, num_workers=2, persistent_workers=True, max_workers=3)
    assert _ids(list(dl)) == list(range(40))
    pids = dl.worker_pids()
    assert _ids(list(dl)) == list(range(40))
    assert dl.worker_pids() == pids
    dl.resize(3)
    wait_for(lambda: len(dl.worker_pids()) == 3, what="third worker")
    assert _ids(list(dl)) == list(range(40))
    assert set(pids) < set(dl.worker_pids())
    dl.close()
    assert all(not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in pids)


def _exited(pid: int) -> bool:
    """The process is gone and reaped (not even a zombie): its memory is free."""
    return not psutil.pid_exists(pid)


def _epoch_matches_torch(dl, ds, num_workers: int) -> bool:
    """One epoch of ``dl`` equals torch's over ``ds`` with ``num_workers`` (every sample once, in order)."""
    got = list(dl)
    ref = _torch_batches(ds, batch_size=4, num_workers=num_workers)
    return len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@pytest.mark.parametrize("iterable", [False, True], ids=["map", "iterable"])
def test_persistent_pool_shrunk_between_epochs_lets_the_retired_workers_exit_before_the_next_epoch(iterable):
    # the agent shrinks a job between epochs to free memory: nobody reads the workers' channels then,
    # and a retired worker must still go (and be reaped) without waiting for the next epoch
    ds = Shards(40) if iterable else Indexed(40)
    dl = DataLoader(ds, batch_size=4, num_workers=3, max_workers=3, persistent_workers=True)
    assert _epoch_matches_torch(dl, ds, 3)
    pids = dl.worker_pids()
    assert len(pids) == 3
    dl.stats()                                  # a memory sample of all three
    dl.resize(1)
    wait_for(lambda: all(_exited(p) for p in pids[1:]), timeout=10, what=f"retired workers {pids[1:]} to exit")
    assert dl.worker_pids() == pids[:1]
    s = dl.stats()
    assert s["live_workers"] == 1 and s["workers"] == 1
    assert s["memory_workers"] <= 1 and set(s["memory"]) <= {str(pids[0])}   # the retired ones' memory is gone
    assert _epoch_matches_torch(dl, ds, 1)
    assert dl.worker_pids() == pids[:1]         # the survivor kept its process
    dl.resize(3)                                # growing back starts new processes
    assert _epoch_matches_torch(dl, ds, 3)
    now = dl.worker_pids()
    assert len(now) == 3 and now[0] == pids[0] and not set(now) & set(pids[1:])
    dl.close()
    wait_for(lambda: all(_exited(p) for p in now), timeout=10, what=f"workers {now} to exit after close()")


def _dead(pid: int) -> bool:
    """Exited (a zombie its parent has not reaped yet, or gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("noticed", ["before-dispatch", "after-dispatch"])
def test_a_persistent_iterable_workers_death_between_epochs_is_replaced_not_an_aborted_epoch(noticed, monkeypatch):
    """A worker of a persistent IterableDataset loader killed between epochs (nobody polls then): the next
    epoch raised RuntimeError "It was iterating its shard ... this epoch is aborted", but it had not
    started that epoch's shard. Now the death is noticed before the epoch's first task (or, if it is
    noticed only after its tasks were handed out, they go to its replacement): the epoch is whole."""
    from adloader._pool import WorkerPool

    ds = Shards(40)
    dl = DataLoader(ds, batch_size=4, num_workers=3, persistent_workers=True)
    try:
        assert _epoch_matches_torch(dl, ds, 3)
        victim = dl.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: _dead(victim), what=f"worker {victim} to die")
        if noticed == "after-dispatch":     # the death is seen by a later poll, as when it races the dispatch
            real, calls = WorkerPool.poll, []

            def late(self, timeout_s):
                calls.append(timeout_s)
                return [] if len(calls) == 1 else real(self, timeout_s)
            monkeypatch.setattr(WorkerPool, "poll", late)
        assert _epoch_matches_torch(dl, ds, 3)
        assert victim not in dl.worker_pids() and len(dl.worker_pids()) == 3
        assert dl.stats()["worker_restarts"] == 1
        assert _epoch_matches_torch(dl, ds, 3)
    finally:
        dl.close()


def test_a_persistent_iterable_worker_killed_mid_shard_still_aborts_the_epoch_and_says_so():
    """A worker that had handed back part of its shard cannot be replayed exactly once: the epoch is
    aborted (the message says it was iterating its shard) and the next epoch has all its workers."""
    ds = Shards(400)
    dl = DataLoader(ds, batch_size=4, num_workers=2, persistent_workers=True)
    try:
        it = iter(dl)
        got = [next(it) for _ in range(4)]            # both workers have handed back batches
        assert {int(b[0][0]) % 2 for b in got} == {0, 1}
        victim = dl.worker_pids()[1]
        os.kill(victim, signal.SIGKILL)
        with pytest.raises(RuntimeError, match="was iterating its shard of an IterableDataset"):
            for _ in it:
                pass
        assert _epoch_matches_torch(dl, ds, 2)
    finally:
        dl.close()


def test_a_worker_retired_mid_epoch_exits_while_the_consumer_is_not_calling_next():
    # a long training step: the consumer holds its batch and does not call next() for a while
    dl = DataLoader(Indexed(60, sleep_s=0.001), batch_size=2, num_workers=3, max_workers=3)
    it = iter(dl)
    got = [next(it) for _ in range(3)]
    pids = dl.worker_pids()
    assert len(pids) == 3
    dl.resize(1)
    wait_for(lambda: all(_exited(p) for p in pids[1:]), timeout=10, what=f"retired workers {pids[1:]} to exit")
    assert dl.worker_pids() == pids[:1] and dl.stats()["live_workers"] == 1
    got += list(it)
    assert _ids(got) == list(range(60))         # what the retired workers finished still arrives, once


def test_abandoned_iterator_stops_its_workers():
    dl = DataLoader(Indexed(200, sleep_s=0.001), batch_size=2, num_workers=2)
    it = iter(dl)
    next(it)
    pids = dl.worker_pids()
    assert len(pids) == 2
    del it
    for p in pids:
        wait_for(lambda: not psutil.pid_exists(p), what=f"worker {p} gone")


def test_stats_keys_and_counters():
    dl = DataLoader(Indexed(24), batch_size=4, num_workers=2, max_workers=2)
    for _ in dl:
        pass
    s = dl.stats()
    assert tuple(s) == STATS_KEYS + ("rates",) + memory.STATS_KEYS + ("memory", "memory_bound_workers")
    assert set(COUNTER_KEYS) | set(GAUGE_KEYS) == set(STATS_KEYS) and not set(COUNTER_KEYS) & set(GAUGE_KEYS)
    assert s["memory_bound_workers"] is None or s["memory_bound_workers"] >= 0   # what memory holds (c616e74)
    assert tuple(s["rates"]) == RATE_KEYS
    assert s["steps"] == 6 and s["samples"] == 24 and s["batches"] >= 6
    assert s["workers"] == 2 and s["max_workers"] == 2 and s["requested_workers"] == 2 and s["batch_size"] == 4
    assert s["worker_wall_s"] > 0 and s["worker_cpu_s"] >= 0 and s["data_wait_s"] > 0
    assert s["rates"]["window_s"] >= 0
    # counters never fall, across a resize and a second epoch; a gauge may
    dl._resize(1, own=False)
    for _ in dl:
        pass
    after = dl.stats()
    assert [k for k in COUNTER_KEYS if after[k] < s[k]] == []
    assert after["workers"] == 1 < s["workers"] and after["epoch"] == s["epoch"] + 1
    dl.close()


def test_a_pause_of_the_training_loop_is_paused_s_not_a_steps_compute():
    """A loop that stops between two next() calls (a validation pass or checkpoint save every N steps, a
    debugger) for many times its pace: the stop is ``paused_s``, and ``compute_s`` keeps the loop's own
    steps. Counted as compute, one 25 s checkpoint among 0.1 s steps made the agent's curve read the GPU
    step 10-40% slower for tens of seconds after each one, and a job validating every 30 s lost a worker
    after every pause."""
    from adloader.stats import PACE_STEPS, PAUSE_MIN_S

    dl = DataLoader(Indexed(64), batch_size=2, num_workers=1)
    it = iter(dl)
    for _ in range(PACE_STEPS + 4):              # quick steps: the loop's pace, far under the pause
        next(it)
    before = dl.stats()
    time.sleep(1.5 * PAUSE_MIN_S)                # the loop stops
    next(it)
    next(it)                                     # (the step after the stop ends at this next())
    s = dl.stats()
    assert s["paused_s"] >= 1.4 * PAUSE_MIN_S
    assert s["compute_s"] - before["compute_s"] < 0.5 * PAUSE_MIN_S
    assert before["paused_s"] == 0.0
    del it


class _Gated(tud.Dataset):
    """Index i; item ``gate_at`` waits until ``gate`` (a file) exists: a worker stuck on its data."""

    def __init__(self, n: int, gate_at: int, gate: str):
        self.n, self.gate_at, self.gate = n, gate_at, gate

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.gate_at:
            while not os.path.exists(self.gate):
                time.sleep(0.01)
        return torch.tensor([i])


def test_away_s_is_how_long_the_loop_has_been_away_from_next_and_0_while_it_waits_for_data(tmp_path):
    """``away_s``: how long the training loop has been out of ``next()`` as the pause happens (a
    validation pass, a checkpoint save), 0 before its first call and while a call waits for data (a loop
    starved of data is no loop that left its loader), and the time since an epoch's end between two."""
    gate = str(tmp_path / "gate")
    dl = DataLoader(_Gated(8, 3, gate), batch_size=1, num_workers=1, prefetch_factor=1)
    assert dl.stats()["away_s"] == 0.0           # no next() yet
    it = iter(dl)
    for _ in range(3):
        next(it)
    time.sleep(0.3)                              # away: a step, or a pause
    assert dl.stats()["away_s"] >= 0.3
    got = []
    waiter = threading.Thread(target=lambda: got.append(next(it)))
    waiter.start()                               # in next(), for batch 3: its worker waits for the gate
    time.sleep(0.3)
    try:
        assert waiter.is_alive() and dl.stats()["away_s"] == 0.0
    finally:
        opened = time.perf_counter()
        open(gate, "w").close()
        waiter.join(30)
    assert got and int(got[0]) == 3
    assert 0.0 <= dl.stats()["away_s"] <= time.perf_counter() - opened     # it came back after the gate opened
    assert [int(b) for b in it] == [4, 5, 6, 7]  # to the epoch's end
    time.sleep(0.2)                              # between two epochs (the validation pass of many loops)
    assert dl.stats()["away_s"] >= 0.2


def test_loader_counters_take_a_step_many_times_the_pace_for_a_pause_and_nothing_else():
    from adloader.stats import PACE_STEPS, PAUSE_FACTOR, LoaderCounters

    c = LoaderCounters()
    c.add_step(30.0, 1.0)                        # the first steps set the pace, however long (a compile)
    for _ in range(PACE_STEPS + 100):
        c.add_step(0.1, 0.01)
    assert c.paused_s == 0.0
    pace, compute, cpu = c.pace_s, c.compute_s, c.step_cpu_s
    assert pace == pytest.approx(0.1, rel=0.05)
    c.add_step(0.9 * PAUSE_FACTOR * pace, 0.5)   # long, but not a pause: compute, and it moves the pace
    assert c.paused_s == 0.0 and c.compute_s == pytest.approx(compute + 0.9 * PAUSE_FACTOR * pace)
    pace, compute, cpu = c.pace_s, c.compute_s, c.step_cpu_s
    c.add_step(25.0, 2.0)                        # a checkpoint save: a pace's worth of compute, the rest paused
    assert c.compute_s == pytest.approx(compute + pace) and c.paused_s == pytest.approx(25.0 - pace)
    assert c.step_cpu_s == pytest.approx(cpu + 2.0 * pace / 25.0) and pace < c.pace_s < 2.0 * pace
    # a lasting change of the step, 15x (layers unfrozen), is not a pause for long: compute from its second step
    c = LoaderCounters()
    for _ in range(PACE_STEPS + 100):
        c.add_step(0.1, 0.01)
    for _ in range(5):
        c.add_step(1.5, 0.01)
    assert c.paused_s == pytest.approx(1.5 - 0.1, rel=0.05)


class _ReadyBatches(tud.IterableDataset):
    """Yields ready-made batches of 8 (for ``batch_size=None``)."""

    def __iter__(self):
        for i in range(5):
            yield torch.arange(i * 8, i * 8 + 8)


@pytest.mark.parametrize("num_workers", [0, 1])
def test_stats_batch_size_is_the_samples_a_delivered_batch_held_where_torch_has_no_batch_size(num_workers):
    """The agent and the tuner read steps as ``samples / batch_size`` (the curve's ceiling is
    ``batch_size / step``). A custom ``batch_sampler`` leaves torch's ``loader.batch_size`` None, which
    they read as 1, while samples were counted from each batch's indices: 8 "steps" per step. Where
    torch has no batch size, stats' ``batch_size`` is the mean of what the delivered batches held. With
    ``batch_size=None`` a batch is one dataset item, counted as one sample: a ready-made batch cannot
    be told from a single sample (a [3, H, W] image is not 3 samples), and 1 keeps steps right."""
    bs = DataLoader(Indexed(48), batch_sampler=[list(range(i, i + n)) for i, n in ((0, 6), (6, 10), (16, 8), (24, 8))],
                    num_workers=num_workers)
    assert bs.batch_size is None and bs.stats()["batch_size"] is None      # nothing delivered yet
    assert [len(b) for b in bs] == [6, 10, 8, 8]
    s = bs.stats()
    assert (s["steps"], s["samples"], s["batch_size"]) == (4, 32, 8)
    bs.close()
    ready = DataLoader(_ReadyBatches(), batch_size=None, num_workers=num_workers)
    assert [len(b) for b in ready] == [8] * 5
    s = ready.stats()
    assert (s["steps"], s["samples"], s["batch_size"]) == (5, 5, 1)
    ready.close()


def test_constructor_checks_like_torch():
    with pytest.raises(ValueError):
        DataLoader(Indexed(4), num_workers=-1)
    with pytest.raises(ValueError):
        DataLoader(Indexed(4), persistent_workers=True)
    with pytest.raises(ValueError):
        DataLoader(Indexed(4), num_workers=3, max_workers=2)
    with pytest.raises(ValueError):
        DataLoader(Indexed(4), batch_size=2, batch_sampler=[[0, 1]])
    dl = DataLoader(Indexed(10), batch_size=3)
    assert len(dl) == 4 and isinstance(dl, tud.DataLoader)
    with pytest.raises(ValueError):
        dl.batch_size = 5
    with pytest.raises(ValueError):
        dl.resize(-1)


def test_bad_worker_counts_are_refused_with_the_argument_and_its_range_named():
    """``resize(n)`` and ``loader.num_workers = n`` said "resize() needs an int" / "needs n >= 0" for
    either way of setting it, without the range or what 0 means; ``max_workers`` of the wrong type was a
    ValueError. Now each names what was set, the range (0 to max_workers, larger clamped) and the value."""
    import re

    dl = DataLoader(Indexed(8), batch_size=2, num_workers=1, max_workers=3)
    rng = re.escape("an int from 0 (load in the main process) to max_workers=3 (a larger one is clamped to it)")
    for set_, name in ((dl.resize, r"resize\(n\): n"), (lambda v: setattr(dl, "num_workers", v), "num_workers")):
        with pytest.raises(ValueError, match=f"^{name} must be {rng}, got -1$"):
            set_(-1)
        for bad, shown in ((2.0, "2.0 (float)"), ("2", "'2' (str)"), (None, "None (NoneType)")):
            with pytest.raises(TypeError, match=f"^{name} must be {rng}, got {re.escape(shown)}$"):
                set_(bad)
        with pytest.raises(TypeError, match='got .auto.: "auto" is taken only when the loader is built'):
            set_("auto")
    with pytest.raises(TypeError, match=re.escape("got True (bool)")):
        dl.resize(True)             # ours only: a bool is no count (num_workers = True is torch's 1)
    assert dl.num_workers == 1 and dl.resize(99) == 3 and dl.resize(0) == 0
    assert _ids(list(dl)) == list(range(8))
    dl.close()
    with pytest.raises(TypeError, match=re.escape("max_workers must be an int >= 0 (the most workers resize() "
                                                  "and the agent may give), got 2.5 (float)")):
        DataLoader(Indexed(4), max_workers=2.5)
    with pytest.raises(ValueError, match="max_workers must be an int >= 0 .*got -1$"):
        DataLoader(Indexed(4), max_workers=-1)


def test_resize_to_zero_mid_epoch_loads_the_rest_in_this_process_exactly_once():
    """docs/users.md: ``resize(0)`` loads the next batches in this process, the workers' queued batches
    come back and the one each is making is still taken from it: every batch once, in order."""
    dl = DataLoader(Indexed(20), batch_size=2, num_workers=2, max_workers=2)
    got = []
    for b in dl:
        got.append(b)
        if len(got) == 2:
            dl.resize(0)
        if len(got) > 6:            # past the prefetch window: no worker takes tasks
            assert dl.stats()["live_workers"] == 0
    assert _ids(got) == list(range(20))
    dl.close()


def test_integer_like_worker_counts_are_taken_like_torch():
    # torch takes any integer for num_workers (it only compares it and range()s over it): a NumPy
    # integer from a config or np.clip, a 0-d integer tensor
    import numpy as np

    for n in (np.int64(2), torch.tensor(1), np.int32(0)):
        dl = DataLoader(Indexed(6), batch_size=2, num_workers=n, max_workers=np.int64(3))
        assert _ids(list(dl)) == list(range(6)) and dl.num_workers == int(n) and dl.max_workers == 3
        dl.resize(np.int64(3))
        dl.num_workers = torch.tensor(1)
        assert dl.num_workers == 1 and _ids(list(dl)) == list(range(6))
        dl.close()
    for bad in (2.0, "2", None):
        with pytest.raises((TypeError, ValueError)):
            DataLoader(Indexed(6), num_workers=bad)


def test_a_bool_worker_count_is_taken_like_torch():
    """torch 2.13's DataLoader takes ``num_workers=True``/``False`` (a bool is an int: its checks compare
    it, and ``_MultiProcessingDataLoaderIter`` starts ``range(True)``, one worker); the loader refused
    both with a TypeError. True is one worker and False none, here too, with torch's own refusals of
    what needs workers (``persistent_workers``, ``prefetch_factor``) when it is False."""
    for flag in (True, False):
        dl = DataLoader(Indexed(6), batch_size=2, num_workers=flag, max_workers=2)
        ref = tud.DataLoader(Indexed(6), batch_size=2, num_workers=flag)
        assert dl.num_workers == int(flag) and type(dl.num_workers) is int and dl.prefetch_factor == ref.prefetch_factor
        it = iter(dl)
        first = next(it)
        assert len(dl.worker_pids()) == int(flag)
        assert _ids([first, *it]) == _ids(list(ref))
        dl.num_workers = not flag                   # the attribute, as torch's (read at the next iter())
        assert dl.num_workers == int(not flag) and _ids(list(dl)) == list(range(6))
        dl.close()
    assert DataLoader(Indexed(6), num_workers=True, persistent_workers=True).num_workers == 1
    for kw in (dict(persistent_workers=True), dict(prefetch_factor=2)):
        with pytest.raises(ValueError) as theirs:
            tud.DataLoader(Indexed(6), num_workers=False, **kw)
        with pytest.raises(ValueError) as ours:
            DataLoader(Indexed(6), num_workers=False, **kw)
        assert str(ours.value) == str(theirs.value)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_other_start_methods(method):
    ds = Indexed(30)
    ref = _ids(_torch_batches(ds, seed=2, batch_size=4, shuffle=True))
    dl = DataLoader(ds, batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(2),
                    num_workers=1, max_workers=2, multiprocessing_context=method, worker_init_fn=init_marks_worker,
                    persistent_workers=True)
    got = []
    for step, b in enumerate(dl):
        got.append(b)
        if step == 1:
            dl.resize(2)
    assert _ids(got) == ref
    pids = dl.worker_pids()
    time.sleep(1.5)   # the condition under test: idle longer than a worker's orphan-check interval
    assert len(_ids(list(dl))) == 30
    assert dl.worker_pids() == pids and dl.stats()["worker_restarts"] == 0
    dl.close()


def test_result_channel_many_tensors_views_empty_and_large_payloads():
    got = list(DataLoader(Awkward(), batch_size=2, num_workers=2, collate_fn=collate_keep_views))
    assert len(got) == 3
    for b, batch in enumerate(got):
        i0 = 2 * b
        assert [int(t[0]) for t in batch["many"][:3]] == [i0 * 1000, i0 * 1000 + 1, i0 * 1000 + 2]
        assert len(batch["many"]) == 600 and int(batch["many"][-1][0]) == (i0 + 1) * 1000 + 299
        assert batch["a_view"].data_ptr() == batch["a"].data_ptr()     # one storage, still shared
        batch["a"][0, 0] = -1
        assert int(batch["a_view"][0]) == -1
        assert batch["empty"].numel() == 0
        assert batch["big"].shape == (2, 300_000) and float(batch["big"][1, -1]) == i0 + 1


def test_result_reader_returns_messages_sent_before_the_worker_closed():
    """A worker that sends its last results and exits: both arrive, then the close is reported."""
    import socket

    from adloader._transport import MessageReader, send_message

    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    send_message(w, ("result", 0, 1), torch.arange(3))
    send_message(w, ("result", 0, 2), torch.arange(4))
    w.close()
    reader = MessageReader(r)
    got = reader.read_available()
    assert [h for h, _ in got] == [("result", 0, 1), ("result", 0, 2)]
    assert [p.tolist() for _, p in got] == [[0, 1, 2], [0, 1, 2, 3]]
    with pytest.raises(EOFError):
        reader.read_available()
    r.close()


def _fake_module(name, **fns):
    import types

    mod = types.ModuleType(name)
    for k, v in fns.items():
        setattr(mod, k, v)
    return mod


def test_hooks_client_and_autotune(monkeypatch):
    import sys

    calls = []
    monkeypatch.setitem(sys.modules, "adloader.env", _fake_module("adloader.env", disabled=lambda: False))
    monkeypatch.setitem(sys.modules, "adloader.client", _fake_module(
        "adloader.client", attach=lambda dl: calls.append(("attach", dl)), detach=lambda dl: calls.append(("detach", dl))))
    monkeypatch.setitem(sys.modules, "adloader.autotune", _fake_module(
        "adloader.autotune", initial_workers=lambda dl: calls.append(("initial", dl)) or 3,
        attach=lambda dl: calls.append(("tune", dl)), detach=lambda dl: calls.append(("untune", dl))))
    dl = DataLoader(Indexed(12), batch_size=4, num_workers="auto", max_workers=2)
    assert calls == [("initial", dl)]
    assert dl.num_workers == 2 and dl.requested_workers == 2        # clamped to max_workers
    assert _ids(list(dl)) == list(range(12))
    assert _ids(list(dl)) == list(range(12))
    assert calls == [("initial", dl), ("attach", dl), ("tune", dl)]    # once, at the first iter()
    dl.close()
    assert calls[3:] == [("detach", dl), ("untune", dl)]
    with pytest.raises(RuntimeError, match="closed"):
        iter(dl)


def test_hooks_never_raise_and_respect_disable(monkeypatch):
    import sys

    def boom(dl):
        raise RuntimeError("agent unreachable")

    seen = []
    monkeypatch.setitem(sys.modules, "adloader.client", _fake_module("adloader.client", attach=boom, detach=boom))
    monkeypatch.setitem(sys.modules, "adloader.autotune", _fake_module("adloader.autotune", initial_workers=boom,
                                                                       attach=boom, detach=boom))
    monkeypatch.setitem(sys.modules, "adloader.env", _fake_module("adloader.env", disabled=lambda: False))
    dl = DataLoader(Indexed(8), batch_size=4, num_workers="auto", max_workers=2)
    assert 1 <= dl.num_workers <= 2
    assert _ids(list(dl)) == list(range(8))
    dl.close()
    monkeypatch.setitem(sys.modules, "adloader.env", _fake_module("adloader.env", disabled=lambda: True))
    monkeypatch.setitem(sys.modules, "adloader.client", _fake_module("adloader.client", attach=seen.append))
    dl = DataLoader(Indexed(8), batch_size=4)
    list(dl)
    assert seen == []


def test_resize_churn_is_not_mistaken_for_deaths(caplog):
    # retiring and starting workers at every step reuses fd numbers within one poll batch; no
    # clean exit may be reported as a death
    dl = DataLoader(Indexed(600), batch_size=2, num_workers=1, max_workers=4)
    with caplog.at_level(logging.WARNING, logger="adloader"):
        got = []
        for step, b in enumerate(dl):
            got.append(b)
            dl.resize(4 if step % 2 == 0 else 1)
    assert _ids(got) == list(range(600))
    assert dl.stats()["worker_restarts"] == 0
    assert not [r for r in caplog.records if "unexpectedly" in r.getMessage()]


def test_oversized_tasks_go_to_one_worker_and_still_arrive_once():
    # 50000 indices pickle to more than the shared queue's message limit (adloader._transport.MAX_TASK_BYTES):
    # such a task goes to one worker's control pipe instead
    from adloader._transport import MAX_TASK_BYTES
    from multiprocessing.reduction import ForkingPickler

    assert len(ForkingPickler.dumps(list(range(50000)))) > MAX_TASK_BYTES
    dl = DataLoader(Indexed(150000), batch_size=50000, num_workers=2, max_workers=2)
    got = list(dl)
    assert [len(b) for b in got] == [50000] * 3
    assert _ids(got) == list(range(150000))


def test_resetting_torch_s_iterator_slot_stops_persistent_workers_and_the_next_epoch_starts_new_ones():
    """``loader._iterator = None`` is how frameworks drop a torch loader's persistent iterator (Lightning's
    teardown, after shutting its workers down): here it stops the persistent workers; the next epoch
    starts new ones and yields the same batches. Only None may be assigned."""
    dl = DataLoader(Indexed(16), batch_size=4, num_workers=2, persistent_workers=True)
    try:
        assert dl._iterator is None
        first = _ids(dl)
        old = set(dl.worker_pids())
        assert len(old) == 2 and dl._iterator is not None
        dl._iterator = None
        assert dl._iterator is None
        wait_for(lambda: not dl.worker_pids(), what="the persistent workers stopped")
        assert not [p for p in old if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        assert _ids(dl) == first
        assert len(dl.worker_pids()) == 2 and not set(dl.worker_pids()) & old
        with pytest.raises(TypeError, match="only be reset to None"):
            dl._iterator = iter([])
    finally:
        dl.close()
