"""Datasets and helpers for the loader tests (a module of its own so spawned workers can import
them by name without importing a test module). Holds no tests."""
from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
import torch.utils.data as tud


class Indexed(tud.Dataset):
    """Sample i is ``tensor([i])``; ``sleep_s`` per sample makes batches take a while."""

    def __init__(self, n: int = 64, sleep_s: float = 0.0):
        self.n = n
        self.sleep_s = sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor([i])


class RandomAug(tud.Dataset):
    """Random 'augmentation' from all three global generators, plus the index."""

    def __init__(self, n: int = 40):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "torch": float(torch.rand(1)), "py": random.random(), "np": float(np.random.rand())}


class WhoAmI(tud.Dataset):
    """Each sample says which worker loaded it and what worker_init_fn left there."""

    def __init__(self, n: int = 24, sleep_s: float = 0.0):
        self.n = n
        self.sleep_s = sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        info = tud.get_worker_info()
        if info is None:
            return (i, -1, 0, os.getpid(), "")
        return (i, info.id, info.num_workers, os.getpid(), os.environ.get("ADLOADER_TEST_INIT", ""))


def init_marks_worker(worker_id: int) -> None:
    os.environ["ADLOADER_TEST_INIT"] = f"init-{worker_id}"


def init_fails(worker_id: int) -> None:
    raise OSError(f"worker_init_fn refuses in worker {worker_id}")


def init_fails_but_in_worker_0(worker_id: int) -> None:
    if worker_id:
        init_fails(worker_id)


class Gated(Indexed):
    """``Indexed`` whose samples wait for the file ``gate`` to exist (60 s at most)."""

    def __init__(self, gate: str, n: int = 16):
        super().__init__(n)
        self.gate = gate

    def __getitem__(self, i):
        deadline = time.monotonic() + 60.0
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().__getitem__(i)


class CpusAtInit(Indexed):
    """``Indexed`` with a folder, ``notes``, where ``init_notes_cpus`` has each worker write the CPUs it ran
    on in its ``worker_init_fn`` (a file, not the environment: a forkserver worker gets the fork server's)."""

    def __init__(self, notes: str, n: int = 24, sleep_s: float = 0.0):
        super().__init__(n, sleep_s)
        self.notes = notes


def init_notes_cpus(worker_id: int) -> None:
    """Write this worker's CPUs to ``<notes>/init-<pid>`` (whole: written aside, then renamed)."""
    path = os.path.join(tud.get_worker_info().dataset.notes, f"init-{os.getpid()}")
    with open(path + ".tmp", "w") as f:
        f.write(" ".join(str(c) for c in sorted(os.sched_getaffinity(0))))
    os.replace(path + ".tmp", path)


class FailsAt(tud.Dataset):
    def __init__(self, n: int = 20, bad: int = 7):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")     # the line the traceback must show
        return i


class Slow(tud.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        time.sleep(1.0)
        return i


class Marked(tud.Dataset):
    """Each ``__getitem__`` leaves ``start-<i>`` in ``where``, sleeps, then leaves ``done-<i>``: whether a
    fetch in flight was allowed to finish."""

    def __init__(self, where: str, n: int = 40, sleep_s: float = 1.0):
        self.where, self.n, self.sleep_s = where, n, sleep_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        open(os.path.join(self.where, f"start-{i}"), "w").close()
        time.sleep(self.sleep_s)
        open(os.path.join(self.where, f"done-{i}"), "w").close()
        return i


class Shards(tud.IterableDataset):
    """An IterableDataset that shards by worker as torch documents; uneven shard lengths."""

    def __init__(self, n: int = 23):
        self.n = n

    def __iter__(self):
        info = tud.get_worker_info()
        k, w = (info.id, info.num_workers) if info is not None else (0, 1)
        for i in range(k, self.n, w):
            yield torch.tensor([i, w])


class Span(tud.IterableDataset):
    """Yields ``range(start, end)``; ``split_span`` (a ``worker_init_fn``) gives each worker's copy its
    part: example 2 of torch's ``IterableDataset`` docs, which shards in ``worker_init_fn`` by
    ``get_worker_info().num_workers``."""

    def __init__(self, n: int = 23):
        self.start, self.end = 0, n

    def __iter__(self):
        return iter(range(self.start, self.end))


def split_span(worker_id: int) -> None:
    info = tud.get_worker_info()
    ds = info.dataset
    per = -(-ds.end // info.num_workers)
    ds.start = info.id * per
    ds.end = min(ds.start + per, ds.end)


class Whole(tud.IterableDataset):
    """An IterableDataset that does not shard: every worker's copy yields all ``n`` items (torch's
    documented duplication with more than one worker)."""

    def __init__(self, n: int = 20):
        self.n = n

    def __iter__(self):
        return iter(range(self.n))


def collate_dict(samples):
    return {"x": torch.stack([s for s in samples]), "n": len(samples)}


def collate_tuple(samples):
    return tuple(int(s) for s in samples), "meta"


class Awkward(tud.Dataset):
    """Samples that stress the result channel: many storages, views of one storage, empty tensors,
    a large by-value payload (NumPy, pickled in-band over several packets)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        base = torch.arange(10) + i
        return {
            "many": [torch.full((2,), i * 1000 + k) for k in range(300)],
            "views": (base[:5], base[5:]),
            "empty": torch.empty(0),
            "big": np.full(300_000, i, dtype=np.float32),
        }


def collate_keep_views(samples):
    """Returns views of one shared tensor per batch (aliasing must survive the trip)."""
    base = torch.stack([s["views"][0] for s in samples])
    return {"a": base, "a_view": base[0], "many": [t for s in samples for t in s["many"]],
            "empty": samples[0]["empty"], "big": np.stack([s["big"] for s in samples])}


class SparseSamples(tud.Dataset):
    """Sample i is a sparse COO matrix (its ``nbytes`` raises RuntimeError, unlike a dense tensor's)."""

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return {"m": (torch.eye(3) * i).to_sparse(), "i": torch.tensor([i])}


def _adloader():
    from adloader import DataLoader

    return DataLoader


class CollatingLoader(_adloader()):
    """A loader subclass whose collate_fn is its own bound method: a spawned worker unpickles the loader."""

    def __init__(self, dataset, **kwargs):
        super().__init__(dataset, collate_fn=self.collate, **kwargs)

    def collate(self, samples):
        return torch.cat(samples) * 10


class HoldsALock(tud.Dataset):
    """Cannot be pickled (a spawned or forkserver worker cannot receive it): it holds a lock."""

    def __init__(self, n: int = 4):
        import threading

        self.n = n
        self.lock = threading.Lock()

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return i


class Pinnable:
    """Stands for a tensor or a batch type with its own ``pin_memory()`` (no accelerator here)."""

    def __init__(self, value, pinned: bool = False):
        self.value, self.pinned = value, pinned

    def pin_memory(self, *args):
        return Pinnable(self.value, pinned=True)


class BatchDict(dict):
    """A dict subclass carrying extra state, as transformers' ``BatchEncoding`` carries ``_encodings``."""


class PinnableMapping(dict):
    """A mapping that pins itself (tensordict's ``TensorDict`` is a ``MutableMapping`` with ``pin_memory``)."""

    def pin_memory(self, *args):
        out = PinnableMapping(self)
        out.pinned_whole = True
        return out


class Pair(tuple):
    """A tuple subclass that is not a namedtuple."""


def collate_pin_containers(samples):
    """Batch structures that torch's ``pin_memory`` rebuilds in ways a naive walk does not."""
    ids = [int(s) for s in samples]
    enc = BatchDict(ids=Pinnable(ids))
    enc.extra = "kept"
    return {"enc": enc, "grouped": __import__("collections").defaultdict(list, {"ids": [Pinnable(ids)]}),
            "whole": PinnableMapping(ids=Pinnable(ids)), "pair": Pair((Pinnable(ids), "meta"))}
