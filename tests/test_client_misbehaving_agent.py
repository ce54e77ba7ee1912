"""A real ``adloader.DataLoader`` (real worker processes) against a node agent that misbehaves: a fake
agent on a real ZeroMQ ROUTER, run by a thread of the test. Whatever the agent does, the batches are
torch's for the same seed, and nothing of the loader or its client is left running after ``close()``."""
from __future__ import annotations

import json
import threading
import time

import pytest
import zmq

from adloader import client, protocol
from tests.conftest import wait_for
from tests.test_client import endpoint_env  # noqa: F401 (fixture)

pytestmark = pytest.mark.component

torch = pytest.importorskip("torch")
tud = pytest.importorskip("torch.utils.data")


class ScriptedAgent(threading.Thread):
    """Welcomes every hello as job "unit-job", then calls ``script(send, n)`` each pass (n counts up)
    until ``stop()``; ``send(msg)`` writes one frame (a dict is JSON-encoded as is, bytes go raw) to the
    last client that said hello."""

    def __init__(self, endpoint: str, script):
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.script = script
        self.hellos = 0
        self.sent = 0
        self._halt = threading.Event()

    def run(self):
        ident, n = None, 0
        while not self._halt.is_set():
            if self.sock.poll(5):
                who, data = self.sock.recv_multipart()
                if protocol.decode(data)["type"] == "hello":
                    ident = who
                    self.hellos += 1
                    self.sock.send_multipart([ident, protocol.encode(
                        protocol.make("welcome", job="unit-job", heartbeat_s=1.0, challenge=None))])
            if ident is not None:
                n += 1
                self.script(lambda m: self._send(ident, m), n)

    def _send(self, ident, msg):
        data = msg if isinstance(msg, bytes) else json.dumps(msg).encode()
        try:
            self.sock.send_multipart([ident, data], zmq.NOBLOCK)
            self.sent += 1
        except zmq.Again:
            pass

    def stop(self):
        self._halt.set()
        self.join(10)
        self.sock.close(0)
        self.ctx.term()


def _client_threads() -> list:
    return [t for t in threading.enumerate() if t.name == "adloader-client"]


def _epochs(loader_cls, epochs: int, **kw) -> list:
    """Every epoch's batches (as lists), the sampler reseeded from 3 before each."""
    from tests.loader_datasets import Indexed

    g = torch.Generator()
    lo = loader_cls(Indexed(96, sleep_s=0.01), batch_size=4, shuffle=True, generator=g, **kw)
    out = []
    try:
        for _ in range(epochs):
            g.manual_seed(3)
            out.append([b.tolist() for b in lo])
    finally:
        if hasattr(lo, "close"):
            lo.close()
    return out


def test_a_resize_loop_leaves_the_batches_torchs_and_bounded_resizes_and_nothing_running_after_close(
        base, endpoint_env, monkeypatch):
    """An agent that sends directives as fast as it can, 0 to 3 workers at random, before, during and after
    training (and after close): each directive was applied (thousands of resizes a second, a worker process
    started for about every hundred; training ran about six times slower). The batches were right then and
    stay right; at most one directive per ``DIRECTIVE_MIN_S`` is applied; after ``close()`` no client
    thread and no worker process is left, though the agent goes on sending. (Children this process had
    before are not the loader's: multiprocessing's resource tracker and forkserver, which an earlier
    test's forkserver loader started and which live as long as the process.)"""
    import psutil

    from adloader import DataLoader

    before = {c.pid for c in psutil.Process().children(recursive=True)}

    expected = _epochs(tud.DataLoader, 2, num_workers=2)
    seq = iter(range(1, 10**9))

    def churn(send, n):
        for _ in range(20):
            send(protocol.make("directive", job="unit-job", seq=next(seq), workers=n % 4, reason="churn"))

    agent = ScriptedAgent(endpoint_env, churn)
    agent.start()
    t0 = time.monotonic()
    try:
        captured = {}

        class Loader(DataLoader):
            def close(self):
                captured["resizes"] = self.stats()["resizes"]
                super().close()

        assert _epochs(Loader, 2, num_workers=2, max_workers=3) == expected
        elapsed = time.monotonic() - t0
        assert agent.hellos >= 1 and agent.sent > 500
        assert captured["resizes"] <= elapsed / client.DIRECTIVE_MIN_S + 2, (captured["resizes"], elapsed)
        wait_for(lambda: not _client_threads(), what="the client thread gone after close, the agent still sending")
        wait_for(lambda: not [c for c in psutil.Process().children(recursive=True) if c.pid not in before],
                 what="no worker process left")
    finally:
        agent.stop()


class _Stream(tud.IterableDataset):
    """0..n-1, sharded by worker."""

    def __init__(self, n: int = 64):
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        wid, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(torch.tensor([i]) for i in range(wid, self.n, workers))


def test_directives_an_iterable_dataset_cannot_take_this_epoch_are_one_warning_not_one_each(caplog):
    """Each directive during an IterableDataset's epoch (its worker shards are fixed: the count waits for
    the next epoch) logged a WARNING: an agent that changed its count every second, or kept sending, wrote
    one line a directive into the user's log for the whole of an endless stream's epoch. Now the first
    says so once (log and ``warnings``), later ones go to DEBUG; the batches are torch's."""
    import logging
    import warnings

    from adloader import DataLoader

    expected = [b.tolist() for b in tud.DataLoader(_Stream(), batch_size=4, num_workers=2)]
    lo = DataLoader(_Stream(), batch_size=4, num_workers=2, max_workers=3)
    got = []
    try:
        with caplog.at_level(logging.WARNING, logger="adloader"), warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            for i, b in enumerate(lo):
                got.append(b.tolist())
                if i < 6:
                    lo._resize(1 if i % 2 else 3, own=False)     # what the agent client calls
    finally:
        lo.close()
    assert got == expected
    said = [r.getMessage() for r in caplog.records if "takes effect at the next epoch" in r.getMessage()]
    assert len(said) == 1, said
    assert len([x for x in w if "takes effect at the next epoch" in str(x.message)]) == 1
