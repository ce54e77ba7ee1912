"""``pin_memory=True`` with workers: batches are pinned on a background thread as they are received,
as torch's multiprocessing iterator pins in its ``_pin_memory_loop`` thread, so that the copy overlaps
the training step instead of adding to the data wait (component tier: real worker processes).

No accelerator here: ``torch.accelerator.is_available`` is faked and a batch is a ``PinProbe``, whose
``pin_memory()`` records the thread it ran on, and can be held on an Event, slowed or made to fail."""
from __future__ import annotations

import collections
import gc
import os
import signal
import sys
import threading
import time

import pytest
import torch
import torch.utils.data as tud

from adloader import DataLoader
from tests.conftest import wait_for

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create")]


class PinLog:
    """What the fake ``pin_memory()`` did in the training process, in call order."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.pins: list[tuple[int, int]] = []        # (batch's first sample, thread ident) per call
        self.hold: dict[int, threading.Event] = {}  # first sample -> the pin waits for this Event
        self.fail: set[int] = set()                 # first samples whose pin raises
        self.pin_s = 0.0                            # a pin's copy time

    def pinned(self) -> list[int]:
        with self.lock:
            return [first for first, _ in self.pins]


_LOG = PinLog()     # replaced by the ``pins`` fixture


class PinProbe:
    """A batch: its samples, the process that collated it, and (once pinned) the pinning thread."""

    def __init__(self, ids, pid, pinned_by=None) -> None:
        self.ids, self.pid, self.pinned_by = ids, pid, pinned_by

    def pin_memory(self, *args):
        log, first = _LOG, self.ids[0]
        with log.lock:
            log.pins.append((first, threading.get_ident()))
        gate = log.hold.get(first)
        if gate is not None:
            gate.wait(5.0)
        if log.pin_s:
            time.sleep(log.pin_s)
        if first in log.fail:
            raise ValueError(f"pin failed for {self.ids}")
        return PinProbe(self.ids, self.pid, threading.get_ident())


def collate_probe(samples):
    return PinProbe([int(s) for s in samples], os.getpid())


def collate_probe_shards(samples):
    """``Shards``' samples are ``tensor([i, num_workers])``."""
    return PinProbe([int(s[0]) for s in samples], os.getpid())


class DiesOnce(tud.Dataset):
    """Sample ``at`` kills the worker that loads it, the first time only (a marker file remembers)."""

    def __init__(self, marker: str, n: int, at: int) -> None:
        self.marker, self.n, self.at = marker, n, at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.at and not os.path.exists(self.marker):
            open(self.marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        return i


@pytest.fixture
def pins(monkeypatch):
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    log = PinLog()
    monkeypatch.setattr(sys.modules[__name__], "_LOG", log)
    yield log
    for gate in list(log.hold.values()):
        gate.set()


def _loader(data, **kw) -> DataLoader:
    data = list(range(data)) if isinstance(data, int) else data
    return DataLoader(data, batch_size=2, collate_fn=collate_probe, pin_memory=True, **kw)


def _firsts(batches) -> list[int]:
    return [b.ids[0] for b in batches]


def _pin_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "adloader-pin"]


def _pinned_as_torch_does(batches, me: int) -> bool:
    """A batch from a worker was pinned on a thread of its own, one run in this process inline."""
    return all(b.pinned_by is not None and (b.pinned_by != me) == (b.pid != os.getpid()) for b in batches)


def test_with_workers_batches_are_pinned_on_a_thread_other_than_the_training_thread(pins):
    me = threading.get_ident()
    dl = _loader(16, num_workers=2)
    try:
        got = list(dl)
    finally:
        dl.close()
    assert _firsts(got) == list(range(0, 16, 2))
    assert all(b.pid != os.getpid() for b in got)
    assert all(b.pinned_by not in (None, me) for b in got)
    assert len({b.pinned_by for b in got}) == 1         # one pin thread for the epoch
    # without workers torch pins inline, in next(); so does the loader
    dl0 = _loader(6, num_workers=0)
    assert [b.pinned_by for b in dl0] == [me] * 3


def test_batches_received_are_pinned_while_the_training_step_computes(pins):
    # a pin takes a while (a large batch's copy into page-locked memory): the batches received at a
    # next() are pinned while the caller computes, not at the next() that returns each of them
    pins.pin_s = 0.02
    me = threading.get_ident()
    workers, prefetch = 2, 2
    dl = _loader(80, num_workers=workers, prefetch_factor=prefetch)
    try:
        it = iter(dl)
        for delivered in range(1, 30):
            next(it)
            received = dl.stats()["batches"]      # results taken in from the workers so far
            if received > delivered:
                break
        assert received > delivered, "no batch was received ahead of the one delivered"
        assert received - delivered <= workers * prefetch      # within the prefetch window
        # the training step: no next() now; every batch received is pinned meanwhile
        wait_for(lambda: len(pins.pinned()) >= received, timeout=10,
                 what=f"the {received - delivered} batch(es) received ahead to be pinned while the step computes")
        assert len(pins.pinned()) == received          # each once, nothing that was not received
        assert all(t != me for _, t in pins.pins)
        rest = list(it)
        assert _firsts(rest) == list(range(2 * delivered, 80, 2))
    finally:
        dl.close()


def test_resize_mid_epoch_keeps_pinned_batches_exactly_once_and_in_order(pins):
    me = threading.get_ident()
    dl = _loader(48, num_workers=1, max_workers=3)
    plan = {3: 3, 8: 1, 12: 0, 15: 2, 19: 3}
    got = []
    try:
        for step, b in enumerate(dl):
            got.append(b)
            if step in plan:
                dl.resize(plan[step])
    finally:
        dl.close()
    assert _firsts(got) == list(range(0, 48, 2))
    assert collections.Counter(pins.pinned()) == collections.Counter(range(0, 48, 2))    # pinned once each
    assert _pinned_as_torch_does(got, me)
    assert {b.pid != os.getpid() for b in got} == {True, False}    # batches of both kinds were seen


def test_a_pin_error_reaches_the_caller_at_its_batch_as_torch_s_does(pins, monkeypatch):
    # torch's pin thread wraps the error (ExceptionWrapper "in pin memory thread for device N") and its
    # iterator raises it at that batch's next(); the epoch goes on with the next batch
    device_set = []
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *a: torch.device("cuda"))
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "set_device_index",
                        lambda i: device_set.append((i, threading.get_ident())))
    pins.fail.add(6)
    me = threading.get_ident()

    def outcomes(loader):
        out = []
        it = iter(loader)
        while True:
            try:
                b = next(it)
            except StopIteration:
                return out
            except Exception as e:      # noqa: BLE001 — the outcome compared
                lines = str(e).splitlines()
                out.append((type(e).__name__, lines[0], lines[-1]))
            else:
                out.append((b.ids, b.pinned_by != me))

    kw = dict(batch_size=2, collate_fn=collate_probe, pin_memory=True, num_workers=2)
    ref = outcomes(tud.DataLoader(list(range(12)), **kw))
    assert ref[3] == ("ValueError", "Caught ValueError in pin memory thread for device 0.",
                      "ValueError: pin failed for [6, 7]")
    device_set.clear()
    dl = DataLoader(list(range(12)), **kw)
    try:
        assert outcomes(dl) == ref
    finally:
        dl.close()
    assert device_set and all(i == 0 and t != me for i, t in device_set)  # the creating thread's device


def test_a_worker_error_is_not_pinned_and_reaches_the_caller_between_pinned_batches(pins):
    from tests.loader_datasets import FailsAt

    me = threading.get_ident()
    dl = _loader(FailsAt(12, 5), num_workers=2)
    try:
        it = iter(dl)
        got = [next(it), next(it)]
        with pytest.raises(ValueError, match="sample 5 is corrupt"):
            next(it)
        got += list(it)
    finally:
        dl.close()
    assert _firsts(got) == [0, 2, 6, 8, 10] and _pinned_as_torch_does(got, me)
    assert 4 not in pins.pinned()


@pytest.mark.parametrize("how", ["close", "drop-iterator", "drop-persistent-loader", "end-of-epoch"])
def test_no_pin_thread_is_left_after_the_epoch_or_the_loader_ends(pins, how):
    me = threading.get_ident()
    dl = _loader(40, num_workers=2, persistent_workers=(how == "drop-persistent-loader"))
    it = iter(dl)
    got = [next(it) for _ in range(4)]
    pinner = {b.pinned_by for b in got}
    assert len(pinner) == 1 and me not in pinner
    assert pinner <= {t.ident for t in _pin_threads()}      # alive during the epoch
    if how == "close":
        dl.close()
    elif how == "drop-iterator":
        del it
        gc.collect()
    elif how == "drop-persistent-loader":
        del it, dl
        gc.collect()
    else:
        assert len(got + list(it)) == 20
    assert _pin_threads() == []
    if how in ("drop-iterator", "end-of-epoch"):
        dl.close()


def test_close_from_another_thread_while_a_batch_is_being_pinned_ends_that_next_and_leaves_no_thread(pins):
    # the trainer waits in next() for a batch whose pin is in progress; close() from another thread
    # ends the epoch: that next() raises StopIteration (the trainer then lets the pin finish), close()
    # waits for the copy in progress, and no pin thread is left
    gate = pins.hold[2] = threading.Event()     # one worker: batch [0, 1] is pinned before [2, 3]
    dl = _loader(40, num_workers=1)
    it = iter(dl)
    assert _firsts([next(it)]) == [0]
    outcome = []

    def trainer():
        try:
            outcome.append(_firsts([next(it)]))
        except StopIteration:
            outcome.append("StopIteration")
        finally:
            gate.set()

    t = threading.Thread(target=trainer)
    t.start()
    wait_for(lambda: 2 in pins.pinned(), timeout=10, what="the pin of batch [2, 3] to start")
    dl.close()
    t.join(10)
    assert outcome == ["StopIteration"]
    assert _pin_threads() == []


@pytest.mark.parametrize("scenario", ["persistent", "break-and-restart", "break-and-restart-persistent",
                                      "state-dict", "dead-worker", "iterable"])
def test_pinned_batches_come_exactly_once_in_order_through(pins, scenario, tmp_path):
    me = threading.get_ident()
    n, expect = 40, list(range(0, 40, 2))
    if scenario == "persistent":
        dl = _loader(n, num_workers=2, persistent_workers=True)
        epochs = [list(dl), list(dl)]
        assert [_firsts(e) for e in epochs] == [expect, expect]
        got = epochs[0] + epochs[1]
    elif scenario.startswith("break-and-restart"):
        dl = _loader(n, num_workers=2, persistent_workers=scenario.endswith("persistent"))
        it = iter(dl)
        first = [next(it) for _ in range(3)]
        again = list(dl)            # a new epoch; the abandoned one's pin thread is gone
        assert _firsts(first) == expect[:3] and _firsts(again) == expect
        assert len(_pin_threads()) <= 1
        got = first + again
    elif scenario == "state-dict":
        ref = [b.ids for b in _loader(n, num_workers=0, shuffle=True, generator=torch.Generator().manual_seed(3))]
        dl = _loader(n, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(3))
        it = iter(dl)
        head = [next(it) for _ in range(5)]
        state = dl.state_dict()
        dl.close()
        dl = _loader(n, num_workers=3, shuffle=True, generator=torch.Generator())
        dl.load_state_dict(state)
        tail = list(dl)
        assert [b.ids for b in head + tail] == ref
        got = head + tail
    elif scenario == "iterable":
        from tests.loader_datasets import Shards

        kw = dict(batch_size=2, collate_fn=collate_probe_shards, num_workers=2)
        ref = [b.ids for b in tud.DataLoader(Shards(n), **kw)]
        dl = DataLoader(Shards(n), pin_memory=True, persistent_workers=True, **kw)
        epochs = [list(dl), list(dl)]
        assert [[b.ids for b in e] for e in epochs] == [ref, ref]
        got = epochs[0] + epochs[1]
    else:
        dl = _loader(DiesOnce(str(tmp_path / "died"), n, at=9), num_workers=2)
        got = list(dl)
        assert os.path.exists(tmp_path / "died") and dl.stats()["worker_restarts"] == 1
        assert _firsts(got) == expect
        assert sorted(pins.pinned()) == expect          # the batch re-run is pinned once
    dl.close()
    assert _pinned_as_torch_does(got, me) and all(b.pid != os.getpid() for b in got)
    assert _pin_threads() == []
