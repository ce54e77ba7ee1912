"""adloader.DataLoader rebuilt by a framework from its instance (Lightning's ``_update_dataloader``,
Accelerate's ``prepare``), ``set_epoch``, the generic class, and the warning when a framework copies
the loader into torch's own (component tier: real worker processes, no framework needed; the real
frameworks run in tests/test_integration_*.py).
"""
from __future__ import annotations

import inspect
import warnings
from typing import List

import pytest
import torch
import torch.utils.data as tud

import adloader.dataloader as dlmod
from adloader import DataLoader
from tests.loader_datasets import Indexed

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create")]


def _ids(batches) -> list[int]:
    return torch.cat([b.flatten() for b in batches]).tolist()


def _rebuild_from_attributes(loader, **replace):
    """What Lightning does for a loader it did not see constructed
    (lightning.fabric.utilities.data._get_dataloader_init_args_and_kwargs, ``was_wrapped`` False):
    the public instance attributes named like ``__init__`` parameters whose value is not the
    parameter's default, plus ``dataset`` and the replaced sampler arguments."""
    attrs = {k: v for k, v in vars(loader).items() if not k.startswith("_")}
    attrs["multiprocessing_context"] = loader.multiprocessing_context
    params = inspect.signature(loader.__init__).parameters
    kwargs = {k: v for k, v in attrs.items() if k in params and params[k].default is not v}
    kwargs["dataset"] = loader.dataset
    kwargs.update(replace)
    return type(loader)(**kwargs)


def test_generic_class_like_torch():
    alias = DataLoader[List[torch.Tensor]]
    assert alias.__origin__ is DataLoader
    loader: DataLoader[List[torch.Tensor]] = DataLoader(Indexed(4), batch_size=2)
    assert _ids(list(loader)) == [0, 1, 2, 3]


def test_torch_constructor_gets_keyword_arguments_only(monkeypatch):
    # Lightning records the positional arguments of the outermost patched __init__ and replays them
    # together with its own keyword arguments: "got multiple values for argument 'sampler'"
    seen = []
    orig = tud.DataLoader.__init__

    def recording(self, *args, **kwargs):
        seen.append((args, sorted(kwargs)))
        orig(self, *args, **kwargs)

    monkeypatch.setattr(tud.DataLoader, "__init__", recording)
    DataLoader(Indexed(8), 4, True, None, None, 2)
    assert seen and seen[0][0] == ()
    assert {"dataset", "batch_size", "shuffle", "num_workers", "sampler"} <= set(seen[0][1])


@pytest.mark.parametrize("num_workers", [2, "auto"])
def test_every_argument_recoverable_and_rebuilt_copy_shares_elastic_state(num_workers):
    user = DataLoader(Indexed(24), batch_size=4, shuffle=True, num_workers=num_workers, max_workers=3,
                      prefetch_factor=3, persistent_workers=True)
    assert vars(user)["num_workers"] == num_workers and vars(user)["max_workers"] == 3
    assert vars(user)["elastic_state"] is user.elastic_state
    sampler = tud.SequentialSampler(range(24))
    copy = _rebuild_from_attributes(user, sampler=sampler, shuffle=False, batch_sampler=None)
    try:
        assert copy.elastic_state is user.elastic_state
        assert vars(copy)["num_workers"] == num_workers and copy.max_workers == 3
        assert copy.prefetch_factor == 3 and copy.persistent_workers
        assert copy.requested_workers == user.requested_workers
        assert _ids(list(copy)) == list(range(24))       # the framework's sampler, in order
        assert user.stats()["steps"] == copy.stats()["steps"] == 6
        assert user.resize(1) == 1 and copy.num_workers == 1       # the user's handle is live
        assert _ids(list(copy)) == list(range(24))
        assert copy.stats()["workers"] == 1
        copy.resize(3)
        assert user.num_workers == 3 and user.stats()["resizes"] == copy.stats()["resizes"]
        # the user's own object keeps its own sampler and (persistent) worker pool
        assert sorted(_ids(list(user))) == list(range(24))
        assert user.stats()["steps"] == 18
    finally:
        user.close()
    assert copy.worker_pids() == []
    with pytest.raises(ValueError, match="closed"):
        DataLoader(Indexed(4), elastic_state=user.elastic_state)


def test_rebuild_of_a_loader_resized_to_zero_still_builds():
    user = DataLoader(Indexed(8), batch_size=4, num_workers=2)
    user.resize(0)           # torch's constructor refuses prefetch_factor with num_workers=0
    copy = _rebuild_from_attributes(user, sampler=tud.SequentialSampler(range(8)), batch_sampler=None)
    assert copy.num_workers == 0 and _ids(list(copy)) == list(range(8))
    user.close()


def test_recorded_arguments_get_the_elastic_state():
    # Lightning's __init__ wrapper stores the outermost call's keyword arguments on the instance
    # before __init__ runs; the rebuilt loader is built from them
    class Recorded(DataLoader):
        def __init__(self, *args, **kwargs):
            object.__setattr__(self, "__pl_saved_kwargs", kwargs)
            super().__init__(*args, **kwargs)

    user = Recorded(Indexed(8), batch_size=4, num_workers=1)
    saved = vars(user)["__pl_saved_kwargs"]
    assert saved["elastic_state"] is user.elastic_state
    copy = DataLoader(user.dataset, **saved)
    assert copy.elastic_state is user.elastic_state

    class OwnSignature(DataLoader):     # cannot take elastic_state: the record stays as it was
        def __init__(self, ds, n):
            object.__setattr__(self, "__pl_saved_kwargs", {})
            super().__init__(ds, batch_size=n)

    assert vars(OwnSignature(Indexed(4), 2))["__pl_saved_kwargs"] == {}


def test_elastic_state_must_be_a_loaders():
    with pytest.raises(TypeError, match="elastic_state"):
        DataLoader(Indexed(4), elastic_state=object())


class _EpochBatches(tud.Sampler):
    def __init__(self):
        self.epoch = 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __iter__(self):
        yield [self.epoch]

    def __len__(self):
        return 1


def test_set_epoch_forwards_to_the_sampler_like_accelerate():
    ds = Indexed(16)
    sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    loader = DataLoader(ds, batch_size=4, sampler=sampler, num_workers=1)
    ref_sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=3)
    ref = tud.DataLoader(ds, batch_size=4, sampler=ref_sampler)
    orders = []
    for epoch in range(3):
        loader.set_epoch(epoch)
        ref_sampler.set_epoch(epoch)
        got = _ids(list(loader))
        assert got == _ids(list(ref))
        orders.append(got)
    assert orders[0] != orders[1] or orders[1] != orders[2]     # reshuffled per epoch
    # a batch sampler with set_epoch gets it
    bs = _EpochBatches()
    loader = DataLoader(ds, batch_sampler=bs)
    loader.set_epoch(5)
    assert _ids(list(loader)) == [5]

    class EpochDataset(tud.IterableDataset):
        epoch = None

        def set_epoch(self, e):
            self.epoch = e

        def __iter__(self):
            yield self.epoch

    it = EpochDataset()
    DataLoader(it, batch_size=None).set_epoch(7)      # no sampler with set_epoch: the dataset's
    assert it.epoch == 7
    DataLoader(Indexed(4)).set_epoch(1)               # nobody takes it: nothing happens


def test_a_framework_copying_the_loader_into_torchs_is_warned_once(monkeypatch):
    monkeypatch.setattr(dlmod, "_foreign_copy_warned", False)
    loader = DataLoader(Indexed(4), num_workers=1)
    assert loader.num_workers == 1          # the user reading it: no warning
    copier = {"__name__": "accelerate.data_loader", "loader": loader}
    with pytest.warns(UserWarning, match="adloader.integrations.accelerate.prepare"):
        exec("loader.num_workers", copier)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        exec("loader.num_workers", copier)          # once per process
    # through a wrapper that forwards attributes (accelerate's prepared loader): the asker decides
    monkeypatch.setattr(dlmod, "_foreign_copy_warned", False)
    wrapper = {"__name__": "accelerate.data_loader"}
    exec("class Adapter:\n    def __init__(self, base): self.base = base\n"
         "    def __getattr__(self, name): return getattr(self.base, name)\n", wrapper)
    prepared = wrapper["Adapter"](loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert prepared.num_workers == 1            # the user reading through the wrapper
    with pytest.warns(UserWarning, match="rebuilding"):
        exec("prepared.num_workers", {"__name__": "accelerate.data_loader", "prepared": prepared})
    monkeypatch.setattr(dlmod, "_foreign_copy_warned", False)
    dlmod._foreign_copy_allowed.on = True           # an integration copying on purpose
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            exec("loader.num_workers", copier)
    finally:
        dlmod._foreign_copy_allowed.on = False
    loader.close()


def test_agent_client_holds_the_users_loader_while_a_copy_trains(monkeypatch):
    import sys
    import types

    calls = []
    fake = types.ModuleType("adloader.client")
    fake.attach = lambda dl: calls.append(("attach", dl))
    fake.detach = lambda dl: calls.append(("detach", dl))
    monkeypatch.setitem(sys.modules, "adloader.client", fake)
    user = DataLoader(Indexed(8), batch_size=4, num_workers=1)
    copy = DataLoader(Indexed(8), batch_size=4, num_workers=1, elastic_state=user.elastic_state)
    assert copy._owner is user            # the copy keeps the user's object alive
    list(copy)
    list(user)
    assert calls == [("attach", user)]    # once per state, with the user's object
    copy.close()
    assert calls[1:] == [("detach", user)]


def test_total_steps_counts_down_across_epochs_resizes_and_rebuilt_copies():
    """``total_steps``: the batches the job has left, reported as ``steps_left`` (the node agent's
    finish guard), counted down as batches are handed out, through epochs, resizes and a framework's
    rebuilt copy (which shares the count); ``set_total_steps`` re-sets or withdraws it; a hint, never
    a limit."""
    user = DataLoader(Indexed(24), batch_size=4, num_workers=2, total_steps=15)
    try:
        assert user.stats()["steps_left"] == 15
        assert _ids(list(user)) == list(range(24))           # epoch 1: 6 steps
        assert user.stats()["steps_left"] == 9
        user.resize(1)
        copy = _rebuild_from_attributes(user, sampler=tud.SequentialSampler(range(24)), batch_sampler=None)
        assert copy.elastic_state is user.elastic_state and copy.stats()["steps_left"] == 9
        assert len(list(copy)) == 6 and user.stats()["steps_left"] == 3
        assert len(list(user)) == 6                          # past the hint: batches as before, 0 left
        assert user.stats()["steps_left"] == 0
        user.set_total_steps(10)
        it = iter(user)
        next(it)
        assert copy.stats()["steps_left"] == 9
        user.set_total_steps(None)
        assert "steps_left" not in user.stats()
        # a copy built with the argument again (Lightning replays the constructor's) keeps the count
        user.set_total_steps(5)
        again = DataLoader(Indexed(24), batch_size=4, num_workers=1, total_steps=100,
                           elastic_state=user.elastic_state)
        assert again.stats()["steps_left"] == 5
    finally:
        user.close()
    for bad in (-1, 2.5, True, "10"):
        with pytest.raises(ValueError, match="total_steps"):
            DataLoader(Indexed(4), total_steps=bad)
        with pytest.raises(ValueError, match="total_steps"):
            DataLoader(Indexed(4)).set_total_steps(bad)


@pytest.mark.parametrize("how", ["deepcopy", "pickle"])
def test_a_deep_or_pickled_copy_is_an_independent_loader_like_torch_s(how):
    # torch's DataLoader can be deep-copied and pickled (sent to another process, kept in a config
    # object that is deep-copied); the copy is a loader with the same arguments and its own workers
    import copy
    import pickle

    clone = copy.deepcopy if how == "deepcopy" else (lambda x: pickle.loads(pickle.dumps(x)))
    kw = dict(batch_size=4, shuffle=True, num_workers=2)
    ref = tud.DataLoader(Indexed(20), generator=torch.Generator().manual_seed(4), **kw)
    want = [b.tolist() for b in clone(ref)]
    user = DataLoader(Indexed(20), generator=torch.Generator().manual_seed(4), max_workers=3, **kw)
    twin = clone(user)
    try:
        assert [b.tolist() for b in twin] == want
        assert twin.elastic_state is not user.elastic_state and twin.max_workers == 3
        twin.resize(1)
        assert user.num_workers == 2 and twin.num_workers == 1
        assert [b.tolist() for b in user] == want
        assert user.stats()["steps"] == twin.stats()["steps"] == 5
        persistent = DataLoader(Indexed(8), batch_size=4, num_workers=1, persistent_workers=True)
        list(persistent)
        again = clone(persistent)                      # after an epoch: its workers stay the original's
        assert _ids(list(again)) == list(range(8)) and again.worker_pids() != persistent.worker_pids()
        again.close()
        persistent.close()
    finally:
        user.close()
        twin.close()


def test_a_subclass_collating_with_its_own_method_runs_spawned_workers():
    # spawn pickles collate_fn, here a bound method: the whole loader goes to the worker, as with torch
    from tests.loader_datasets import CollatingLoader

    dl = CollatingLoader(Indexed(6), batch_size=2, num_workers=1, multiprocessing_context="spawn")
    try:
        assert [b.tolist() for b in dl] == [[0, 10], [20, 30], [40, 50]]
    finally:
        dl.close()
