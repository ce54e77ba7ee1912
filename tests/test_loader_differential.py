"""Differential property: adloader.DataLoader against torch's DataLoader over the options the other
loader tests hold fixed: a custom ``batch_sampler``, a sampler without ``__len__``, ``batch_size=None``
with and without a ``collate_fn``, samples that are dicts / namedtuples / tuples of strings and NumPy
arrays / nested, ``prefetch_factor``, persistent workers, ``in_order``, the generator or torch's
global RNG, a dataset that raises on one index; with live resizes at any step of any epoch. Each epoch
must equal torch's loader (started with the same worker count): the same batches in the same order,
the same exception type at the same step (``in_order=False``: the same batches and errors, once each).
IterableDatasets: each epoch equals torch's for the worker count in effect when it starts, sharded
in ``__iter__`` or in ``worker_init_fn``, persistent or not. Real worker processes (fork)."""
from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adloader import DataLoader
from tests.loader_datasets import Shards, Span, split_span

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create"),
              pytest.mark.filterwarnings("ignore:.*takes effect at the next epoch")]

N = 13
EPOCHS = 2
Point = collections.namedtuple("Point", "i sq")


class Samples(tud.Dataset):
    """Sample ``i`` in one of several shapes; ``bad`` raises ValueError."""

    def __init__(self, kind: str, bad=None):
        self.kind, self.bad = kind, bad

    def __len__(self):
        return N

    def __getitem__(self, i):
        if i == self.bad:
            raise ValueError(f"sample {i} is corrupt")
        kind = self.kind
        if kind == "dict":
            return {"i": i, "t": torch.tensor([i, i * i]), "s": f"x{i}"}
        if kind == "namedtuple":
            return Point(i, torch.tensor(i * i))
        if kind == "tuple":
            return (i, f"s{i}", np.array([i, 2 * i]))
        if kind == "nested":
            return {"a": [torch.tensor(i), (i, f"{i}")], "b": {"c": np.float64(i)}}
        return torch.tensor([i])


class VariableBatches:
    """A custom batch sampler: batches of 1, 2, 3, 1, 2, ... indices, reversed order."""

    def __iter__(self):
        order, k = list(range(N - 1, -1, -1)), 1
        while order:
            yield order[:k]
            order, k = order[k:], k % 3 + 1

    def __len__(self):
        return sum(1 for _ in self)


class NoLen(tud.Sampler):
    """A sampler without ``__len__``: odd indices, then even ones."""

    def __init__(self):
        pass

    def __iter__(self):
        return iter(list(range(1, N, 2)) + list(range(0, N, 2)))


def tag(batch):
    """A custom collate_fn: the samples as they came, marked."""
    return ("collated", batch)


def _plain(x):
    """A batch as plain, comparable values (types kept)."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), x.tolist())
    if isinstance(x, np.ndarray):
        return ("ndarray", str(x.dtype), x.tolist())
    if isinstance(x, dict):
        return (type(x).__name__, {k: _plain(v) for k, v in x.items()})
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_plain(v) for v in x])
    return (type(x).__name__, x)


def _epochs(dl, resizes=()):
    """``EPOCHS`` epochs of ``dl``, each a list of plain batches or ("raised", type) entries; after the
    batch at ``(epoch, step)`` of ``resizes`` (step -1: before the epoch) ``dl.resize(n)``."""
    at = collections.defaultdict(list)
    for epoch, step, n in resizes:
        at[(epoch, step)].append(n)
    out = []
    for epoch in range(EPOCHS):
        for n in at[(epoch, -1)]:
            dl.resize(n)
        got, it = [], iter(dl)
        while True:
            try:
                got.append(_plain(next(it)))
            except StopIteration:
                break
            except ValueError as e:
                assert "is corrupt" in str(e)
                got.append(("raised", type(e).__name__))
            for n in at[(epoch, len(got) - 1)]:
                dl.resize(n)
        out.append(got)
    return out


indexing = st.sampled_from([
    dict(batch_size=3, shuffle=True), dict(batch_size=2, shuffle=True, drop_last=True), dict(batch_size=4),
    dict(batch_sampler=VariableBatches()), dict(sampler=NoLen(), batch_size=2), dict(sampler=NoLen(), batch_size=None),
    dict(batch_size=None, shuffle=True), dict(batch_size=None, collate_fn=tag), dict(batch_size=3, collate_fn=tag)])


@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(kind=st.sampled_from(["tensor", "dict", "namedtuple", "tuple", "nested"]), kw=indexing,
       start=st.integers(0, 3), persistent=st.booleans(), in_order=st.booleans(),
       prefetch=st.sampled_from([None, 1, 5]), seeded=st.booleans(), bad=st.sampled_from([None, 4]),
       data=st.data())
def test_map_style_epochs_equal_torch_s_whatever_the_options_and_resizes(kind, kw, start, persistent, in_order,
                                                                           prefetch, seeded, bad, data):
    persistent = persistent and start > 0           # torch: persistent_workers needs num_workers > 0
    # torch's persistent workers, once one raised, take 5 s each to stop (MP_STATUS_CHECK_INTERVAL)
    bad = None if persistent else bad
    # a persistent loader resized to 0 for a whole epoch draws as torch's in-process iterator would
    # (documented): the reference keeps its workers, so such a loader only goes to 0 mid-epoch
    low = 1 if persistent else 0
    resizes = data.draw(st.lists(st.tuples(st.integers(0, EPOCHS - 1), st.integers(-1, 6), st.integers(low, 3)),
                                 max_size=4), label="resizes")
    if persistent:      # back to a worker before each epoch ends
        resizes += [(e, s, 1) for e, s, n in resizes if n == 0]
    options = dict(kw, persistent_workers=persistent, in_order=in_order,
                   prefetch_factor=prefetch if start > 0 else None)

    def run(cls, extra, plan):
        if not seeded:
            torch.manual_seed(1234)
        gen = torch.Generator().manual_seed(1234) if seeded else None
        dl = cls(Samples(kind, bad), num_workers=start, generator=gen, **options, **extra)
        try:
            return _epochs(dl, plan)
        finally:
            getattr(dl, "close", lambda: None)()

    ref = run(tud.DataLoader, {}, ())
    got = run(DataLoader, dict(max_workers=3), resizes)
    if not in_order:
        ref, got = ([sorted(map(repr, epoch)) for epoch in r] for r in (ref, got))
    assert got == ref


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(counts=st.lists(st.integers(0, 3), min_size=3, max_size=3), mid=st.booleans(), persistent=st.booleans(),
       by_init=st.booleans(), batch_size=st.sampled_from([None, 1, 3]))
def test_iterable_epochs_equal_torch_s_for_the_count_each_starts_with(counts, mid, persistent, by_init, batch_size):
    """``counts[e]``: the workers epoch ``e`` starts with; each change is made mid-epoch (``mid``, it
    waits for the next epoch) or between epochs."""
    counts[0] = max(counts[0], 1) if persistent else counts[0]

    def dataset():
        return Span(17) if by_init else Shards(17)

    def shards(n):
        return dict(worker_init_fn=split_span) if by_init and n > 0 else {}

    dl = DataLoader(dataset(), batch_size=batch_size, num_workers=counts[0], max_workers=3,
                    persistent_workers=persistent, **shards(1))
    try:
        for epoch, n in enumerate(counts):
            ref = [_plain(b) for b in tud.DataLoader(dataset(), batch_size=batch_size, num_workers=n, **shards(n))]
            nxt = counts[epoch + 1] if epoch + 1 < len(counts) else None
            got = []
            for b in dl:
                got.append(_plain(b))
                if mid and nxt is not None and len(got) == 2:
                    dl.resize(nxt)
            assert got == ref, f"epoch {epoch} with {n} workers"
            if nxt is not None:
                dl.resize(nxt)
    finally:
        dl.close()
