"""No worker process outlives its loader: abandoned iterators, close(), and interpreter exit
(checked from outside, on a child Python process)."""
from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import psutil
import pytest

from tests.conftest import REPO, repo_env, wait_for

pytestmark = pytest.mark.component

CHILD = textwrap.dedent("""
    import json, os, sys, time
    import torch
    from adloader import DataLoader
    from tests.loader_datasets import Indexed
    mode = sys.argv[1]
    dl = DataLoader(Indexed(10_000, sleep_s=0.001), batch_size=4, num_workers=2, max_workers=3,
                    persistent_workers=(mode == "persistent"), multiprocessing_context=sys.argv[2])
    it = iter(dl)
    for _ in range(3):
        next(it)
    dl.resize(3)
    for _ in range(3):
        next(it)
    print(json.dumps(dl.worker_pids()), flush=True)
    if mode == "abandon":
        del it
        import gc; gc.collect()
        print(json.dumps(dl.worker_pids()), flush=True)
    elif mode == "close":
        dl.close()
        print(json.dumps(dl.worker_pids()), flush=True)
    elif mode == "sigterm-parent":
        time.sleep(60)
    # "exit" and "persistent": leave mid-epoch with live workers and a live iterator
""")


def _gone(pids):
    def check():
        for p in pids:
            try:
                if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True
    return check


@pytest.mark.parametrize("mode,method", [("exit", "fork"), ("persistent", "fork"), ("abandon", "fork"),
                                         ("close", "fork"), ("exit", "spawn")])
def test_no_worker_left_behind(mode, method):
    out = subprocess.run([sys.executable, "-c", CHILD, mode, method], env=repo_env(), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.strip().splitlines()
    pids = json.loads(lines[0])
    assert len(pids) == 3
    if mode in ("abandon", "close"):
        assert json.loads(lines[1]) == []
    wait_for(_gone(pids), timeout=10, what=f"workers {pids} to exit")


@pytest.mark.parametrize("method", ["fork", "forkserver"])
def test_workers_exit_when_the_training_process_is_killed(method):
    proc = subprocess.Popen([sys.executable, "-c", CHILD, "sigterm-parent", method], env=repo_env(), cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        pids = json.loads(proc.stdout.readline())
        assert len(pids) == 3
        proc.kill()           # SIGKILL: no atexit, no finalizer runs in the parent
        proc.wait(timeout=10)
        wait_for(_gone(pids), timeout=15, what=f"orphaned workers {pids} to notice and exit")
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


FORKED = textwrap.dedent("""
    import gc, json, os, sys
    import torch
    from adloader import DataLoader
    from tests.loader_datasets import Indexed
    dl = DataLoader(Indexed(400), batch_size=4, num_workers=2)
    it = iter(dl)
    got = [int(x) for x in next(it)]
    pids = dl.worker_pids()
    child = os.fork()
    if child == 0:
        # a process forked from the training process (a worker of another loader, a user's
        # subprocess) drops its copy of the loader: it must not shut down the parent's workers
        del it, dl
        gc.collect()
        if sys.argv[1] == "sys.exit":
            sys.exit(0)     # the interpreter's exit: atexit runs (multiprocessing's exit function too)
        os._exit(0)
    _, status = os.waitpid(child, 0)
    for i, b in enumerate(it):
        got += [int(x) for x in b]
        if i == 50:
            same = dl.worker_pids() == pids        # (the epoch's end stops them: compare before)
    print(json.dumps({"exact": got == list(range(400)), "same_workers": same, "child_status": status}))
""")


@pytest.mark.parametrize("exit_by", ["os._exit", "sys.exit"])
def test_a_forked_copy_of_a_loader_leaves_the_parents_workers_alone(exit_by):
    """A child the training process forks (os.fork: an asynchronous checkpoint writer) that ends by
    the interpreter's own exit ran multiprocessing's atexit function, which terminates every daemon
    process in multiprocessing's list of children, inherited from the parent: the parent's loader
    workers were killed by SIGTERM (the epoch recovered them here, torch's loader would have failed;
    an IterableDataset epoch was aborted)."""
    out = subprocess.run([sys.executable, "-c", FORKED, exit_by], env=repo_env(ADLOADER_DISABLE="1"), cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res == {"exact": True, "same_workers": True, "child_status": 0}, out.stderr
    assert "Traceback" not in out.stderr and "died" not in out.stderr, out.stderr


TRAINER_HANDLERS = textwrap.dedent("""
    import json, os, signal, sys
    from adloader import DataLoader
    from tests.loader_datasets import WhoAmI

    def trainer_handler(sig, frame):      # as Lightning's SIGTERM handler: note it, carry on
        with open(sys.argv[1], "a") as f:
            f.write(f"{os.getpid()} {sig}\\n")

    signal.signal(signal.SIGTERM, trainer_handler)
    signal.signal(signal.SIGUSR1, trainer_handler)
    dl = DataLoader(WhoAmI(300, sleep_s=0.01), batch_size=2, num_workers=2)
    it = iter(dl)
    got, loaded_by = [], set()
    while len(loaded_by) < 2:             # both workers have run a task: their set-up is done
        i, _, _, pid, _ = next(it)
        got += i.tolist()
        loaded_by.update(pid.tolist())
    a, b = dl.worker_pids()
    os.kill(a, signal.SIGUSR1)
    os.kill(b, signal.SIGTERM)
    for k, (i, _, _, pid, _) in enumerate(it):
        got += i.tolist()
        if k == 40:
            during = dl.worker_pids()
    print(json.dumps({"exact": got == list(range(300)), "a": a, "b": b, "during": during}))
""")


def test_a_worker_does_not_run_the_training_processs_signal_handlers(tmp_path):
    """Handlers the trainer installed (Lightning's SIGTERM one) are not run by a forked worker:
    SIGTERM (the pool's terminate) kills it, another signal the trainer catches is ignored, and the
    epoch loses nothing."""
    ran = tmp_path / "handler-ran"
    out = subprocess.run([sys.executable, "-c", TRAINER_HANDLERS, str(ran)], env=repo_env(ADLOADER_DISABLE="1"),
                         cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert not ran.exists(), f"the trainer's handler ran in a worker: {ran.read_text()}"
    assert res["exact"], out.stderr
    assert res["a"] in res["during"] and res["b"] not in res["during"], (res, out.stderr)
    assert f"pid {res['b']}" in out.stderr and "Terminated" in out.stderr, out.stderr


def test_a_fetch_in_flight_finishes_before_its_worker_is_stopped(tmp_path):
    """An abandoned iterator stops its workers as torch's does: each finishes the ``__getitem__`` it is
    in (torch waits ``MP_STATUS_CHECK_INTERVAL``, 5 s, before terminating), so a dataset is not cut off
    mid-fetch, and none starts another after it was told to exit."""
    import gc
    import os
    import time

    from adloader import DataLoader
    from tests.loader_datasets import Marked

    dl = DataLoader(Marked(str(tmp_path), sleep_s=1.0), batch_size=1, num_workers=1)
    it = iter(dl)
    assert int(next(it)) == 0
    wait_for(lambda: (tmp_path / "start-1").exists(), timeout=30, what="the worker to start its next fetch")
    pids = dl.worker_pids()
    assert len(pids) == 1
    del it
    gc.collect()
    assert (tmp_path / "done-1").exists(), sorted(os.listdir(tmp_path))   # the fetch in flight finished
    assert dl.worker_pids() == []
    wait_for(_gone(pids), timeout=10, what=f"worker {pids} to exit")
    time.sleep(1.5)                                                       # a fetch it might have started
    assert sorted(p.name for p in tmp_path.iterdir()) == ["done-0", "done-1", "start-0", "start-1"]


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("num_workers", [0, 2])
def test_epochs_and_loaders_leave_no_file_descriptor_open(num_workers):
    # each iterator (a new one every epoch without persistent workers) and each loader's stats() read
    # /proc/self/schedstat: torch's loader leaves nothing open after an epoch, and neither may this one
    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    def epochs():
        dl = DataLoader(Indexed(8), batch_size=4, num_workers=num_workers, max_workers=2)
        for _ in range(3):
            assert len(list(dl)) == 2
        dl.stats()
        dl.close()

    epochs()
    gc.collect()
    before = _open_fds()
    for _ in range(10):
        epochs()
    gc.collect()
    wait_for(lambda: _open_fds() <= before, timeout=10,
             what=f"open file descriptors back to {before} (now {_open_fds()})")


def test_workers_that_cannot_start_raise_like_torch_and_leave_no_file_descriptor_open():
    # spawn pickles the dataset for each worker: one holding a lock cannot go, in torch as here
    from adloader import DataLoader
    from tests.loader_datasets import HoldsALock

    def attempt():
        dl = DataLoader(HoldsALock(), batch_size=2, num_workers=2, multiprocessing_context="spawn")
        with pytest.raises(TypeError, match="pickle"):
            iter(dl)

    attempt()
    gc.collect()
    before = _open_fds()
    for _ in range(5):
        attempt()
    gc.collect()
    wait_for(lambda: _open_fds() <= before, timeout=10,
             what=f"open file descriptors back to {before} (now {_open_fds()})")


SIGNAL_ERROR = "DataLoader worker (pid 1) is killed by signal: Killed."    # torch's SIGCHLD handler's words


def _iterating_with_a_join_that_raises_once():
    """A loader with two workers mid-epoch whose first worker's join raises once, as a signal handler
    raises out of a wait: (loader, iterator, its pool, the workers' pids)."""
    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    dl = DataLoader(Indexed(10_000, sleep_s=0.001), batch_size=4, num_workers=2, max_workers=2)
    it = iter(dl)
    next(it)
    pool = it._pool
    pids = pool.worker_pids()
    assert len(pids) == 2
    first = next(iter(pool.slots.values()))
    real_join, calls = first.proc.join, []

    def join(*a, **kw):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError(SIGNAL_ERROR)
        return real_join(*a, **kw)

    first.proc.join = join
    return dl, it, pool, pids


def test_a_shutdown_interrupted_by_a_signal_handlers_error_still_stops_every_worker():
    """torch's SIGCHLD handler raises ("DataLoader worker ... is killed by signal") wherever the main
    thread is, also inside this pool's wait for its own workers when a worker of a torch DataLoader of
    the same process dies. The shutdown is not retried (it is idempotent), so it must finish: every
    worker stopped, every channel closed, and then the error raised."""
    dl, it, pool, pids = _iterating_with_a_join_that_raises_once()
    with pytest.raises(RuntimeError, match="killed by signal"):
        pool.shutdown()
    wait_for(_gone(pids), timeout=10, what=f"workers {pids} gone after the interrupted shutdown")
    assert pool._epoll.closed and pool._reap_epoll.closed
    pool.shutdown()                   # idempotent: nothing more to do, nothing raised
    del it
    dl.close()


def test_a_shutdown_at_garbage_collection_logs_what_interrupted_it_instead_of_raising_it(monkeypatch, caplog):
    """An iterator collected mid-epoch stops its workers from its weakref.finalize, where an error raised
    out of the shutdown (torch's SIGCHLD handler's, as above) reached no caller: Python printed
    "Exception ignored in: <finalize object ...>" and pytest warned PytestUnraisableExceptionWarning.
    It is logged with its traceback; nothing is unraisable, every worker and channel is gone."""
    import logging

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    dl, it, pool, pids = _iterating_with_a_join_that_raises_once()
    with caplog.at_level(logging.WARNING, logger="adloader"):
        del it
        gc.collect()
    assert [(u.exc_type, str(u.exc_value)) for u in unraisable] == []
    wait_for(_gone(pids), timeout=10, what=f"workers {pids} gone after the collected iterator's shutdown")
    assert pool._epoll.closed and pool._reap_epoll.closed
    said = [r for r in caplog.records if "garbage-collected" in r.getMessage()]
    assert len(said) == 1 and SIGNAL_ERROR in said[0].getMessage() and said[0].exc_info is not None
    dl.close()


def test_a_close_the_user_calls_still_raises_what_interrupted_the_shutdown(monkeypatch):
    """close() is the user's own call: the error reaches it (once, after every worker stopped), and the
    iterator's finalizer, detached, does not run the shutdown again when the iterator is collected."""
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    dl, it, pool, pids = _iterating_with_a_join_that_raises_once()
    with pytest.raises(RuntimeError, match="killed by signal"):
        dl.close()
    wait_for(_gone(pids), timeout=10, what=f"workers {pids} gone after close()")
    assert pool._epoll.closed and not it._pool_finalizer
    del it
    gc.collect()
    assert unraisable == []


SIGCHLD_CHILD = textwrap.dedent("""
    import gc, json, signal, sys
    from adloader import DataLoader
    from tests.loader_datasets import Indexed
    dl = DataLoader(Indexed(10_000, sleep_s=0.001), batch_size=4, num_workers=2, max_workers=2)
    it = iter(dl)
    next(it)
    pids = it._pool.worker_pids()
    raised = []

    def on_sigchld(signum, frame):   # as torch's handler does for a dead worker of a torch DataLoader
        if not raised:
            raised.append(signum)
            raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Killed.")

    signal.signal(signal.SIGCHLD, on_sigchld)
    del it                            # the iterator's finalizer stops the workers: each exit is a SIGCHLD
    gc.collect()
    print(json.dumps({"pids": pids, "raised": len(raised)}), flush=True)
""")


def test_a_signal_handlers_error_in_a_collected_iterators_shutdown_is_not_an_ignored_exception():
    """The same with a real SIGCHLD handler that raises, in a process of its own: nothing is printed as
    "Exception ignored", the handler's error is logged, the workers are gone."""
    out = subprocess.run([sys.executable, "-c", SIGCHLD_CHILD], cwd=REPO, env=repo_env(), capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["raised"] == 1 and len(got["pids"]) == 2
    assert "Exception ignored" not in out.stderr, out.stderr
    assert "killed by signal" in out.stderr and "garbage-collected" in out.stderr, out.stderr
    wait_for(_gone(got["pids"]), timeout=10, what=f"workers {got['pids']} gone")
