"""Lightning: the loader built in the hook (adloader first imported there, after Lightning), passed to
`fit`, and `num_workers="auto"`; no integration module but the StepsLeft callback
(``adloader.integrations.lightning``), with the real framework on CPU (1 process, and 2 over gloo with
a live agent). The framework tier: `-m frameworks` selects it; it skips with the reason where the framework is absent
(`./run setup` installs the [frameworks] extra). What each run checks: tests/integration_train.py.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.integration_train import one_process, two_processes_with_agent

pytestmark = [pytest.mark.component, pytest.mark.frameworks,
              pytest.mark.skipif(importlib.util.find_spec("lightning") is None,
                                 reason="lightning is not installed (pip install -e '.[frameworks]' -c constraints-frameworks.txt)")]

RUNS = {"hook": 2, "passed": 2, "auto": 1}


def test_one_process(tmp_path):
    one_process("lightning", RUNS, str(tmp_path))


def test_two_processes_gloo_with_a_live_agent(base, tmp_path):
    two_processes_with_agent("lightning", RUNS, base, str(tmp_path))


@pytest.mark.parametrize("how, num_workers", [("attributes", "auto"), ("recorded", 1),
                                              ("subclass made inside the hook", "auto")])
def test_lightning_rebuild_with_a_distributed_sampler_shares_the_state(how, num_workers):
    """Lightning's own rebuild (lightning.pytorch.utilities.data._update_dataloader), in process:
    from the instance's attributes (a loader Lightning did not see built), from the arguments its
    __init__ wrapper recorded (built in a hook), and for a class created after Lightning patched
    the DataLoader classes (only the base classes' wrappers record)."""
    import torch.utils.data as tud
    from lightning.fabric.utilities.data import _replace_dunder_methods
    from lightning.pytorch.utilities.data import _update_dataloader

    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    ds = Indexed(16)
    if how == "attributes":
        user = DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers, max_workers=2)
    else:
        with _replace_dunder_methods(tud.DataLoader, "dataset"):
            cls = DataLoader
            if how != "recorded":
                class Late(DataLoader):
                    pass
                cls = Late
            # dataset and batch_size positional, as users write them (shuffle positional fails in
            # Lightning's rebuild with torch's own DataLoader too: it passes shuffle=False again)
            user = cls(ds, 4, shuffle=True, num_workers=num_workers, max_workers=2)
    sampler = tud.DistributedSampler(ds, num_replicas=2, rank=1, shuffle=True, seed=0)
    copy = _update_dataloader(user, sampler)
    try:
        assert isinstance(copy, DataLoader) and copy is not user and type(copy) is type(user)
        assert copy.elastic_state is user.elastic_state and copy.sampler is sampler
        assert vars(copy)["num_workers"] == num_workers and copy.max_workers == 2
        got = [int(i) for b in copy for i in b.flatten()]
        assert got == [int(i) for b in tud.DataLoader(ds, batch_size=4, sampler=sampler) for i in b.flatten()]
        assert user.stats()["steps"] == 2
        user.resize(2)
        assert copy.num_workers == 2
    finally:
        user.close()


def test_steps_left_callback_counts_the_runs_batches_fresh_and_resumed(tmp_path):
    """``adloader.integrations.lightning.StepsLeft``: the train loader is told the batches the run has
    left at its start, (estimated_stepping_batches - global_step) x accumulate_grad_batches: 12 batches
    an epoch, 2 epochs, counted down to 0 at the last batch, with gradient accumulation 1 and 2; a fit
    resumed from that checkpoint with 4 epochs is told the 24 batches it has left, not the run's 48; a
    list of train loaders is told the same, a shorter loader in a CombinedLoader(mode="max_size") its own
    part; the count is withdrawn at the end; a run of unknown length
    (an iterable without ``max_steps``) is told nothing."""
    import lightning as L
    import torch

    from adloader import DataLoader
    from adloader.integrations.lightning import StepsLeft

    ds = torch.utils.data.TensorDataset(torch.randn(96, 4), torch.randn(96, 1))
    seen = []

    class M(L.LightningModule):
        def __init__(self, loaders):
            super().__init__()
            self.lin, self.loaders = torch.nn.Linear(4, 1), loaders

        def training_step(self, batch, i):
            seen.append([lo.stats().get("steps_left") for lo in self.loaders])
            x, y = batch[0] if isinstance(batch, list) and isinstance(batch[0], (list, tuple)) else batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.01)

    def fit(loaders, epochs, acc, root, ckpt=None, train=None):
        seen.clear()
        t = L.Trainer(max_epochs=epochs, accumulate_grad_batches=acc, callbacks=[StepsLeft()], logger=False,
                      default_root_dir=str(root), enable_progress_bar=False, enable_model_summary=False,
                      accelerator="cpu", devices=1)
        t.fit(M(loaders), train if train is not None else (loaders[0] if len(loaders) == 1 else loaders),
              ckpt_path=ckpt)
        return t

    for acc in (1, 2):
        loader = DataLoader(ds, batch_size=8, num_workers=1)
        t = fit([loader], 2, acc, tmp_path / f"a{acc}")
        assert [s[0] for s in seen] == list(range(23, -1, -1)), (acc, seen)
        assert loader.stats().get("steps_left") is None                    # withdrawn at the end
        fit([loader], 4, acc, tmp_path / f"b{acc}", ckpt=t.checkpoint_callback.best_model_path)
        assert [s[0] for s in seen] == list(range(23, -1, -1)), (acc, seen)
    pair = [DataLoader(ds, batch_size=8, num_workers=1), DataLoader(ds, batch_size=8, num_workers=0)]
    fit(pair, 1, 1, tmp_path / "pair")
    assert seen[0] == [11, 11] and seen[-1] == [0, 0]
    # CombinedLoader(mode="max_size"): the shorter loader hands out its 6 batches an epoch, then
    # nothing until the next; it is told its own 12, not the run's 24
    from lightning.pytorch.utilities import CombinedLoader

    short_ds = torch.utils.data.TensorDataset(torch.randn(48, 4), torch.randn(48, 1))
    pair = [DataLoader(ds, batch_size=8, num_workers=1), DataLoader(short_ds, batch_size=8, num_workers=0)]
    fit(pair, 2, 1, tmp_path / "max_size", train=CombinedLoader(pair, "max_size"))
    assert [s[0] for s in seen] == list(range(23, -1, -1)), seen
    assert [s[1] for s in seen] == [12 - 6 * e - 1 - min(i, 5) for e in range(2) for i in range(12)], seen

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter([(torch.randn(4), torch.randn(1)) for _ in range(40)])

    stream = DataLoader(Stream(), batch_size=8, num_workers=0)
    fit([stream], 1, 1, tmp_path / "stream")
    assert len(seen) == 5 and all(s == [None] for s in seen)


def test_persistent_workers_do_not_outlive_fit_as_torch_s_do_not(tmp_path):
    """Lightning's teardown of a run shuts down a torch loader's persistent workers and sets its
    ``_iterator`` to None (``_shutdown_workers_and_reset_iterator``). adloader's workers used to stay
    alive after ``trainer.fit()`` returned, holding their memory until the loader was collected; now
    they stop as torch's do, and the loader trains again in the next run with new workers."""
    import lightning as L
    import psutil
    import torch

    from adloader import DataLoader

    ds = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 1))

    class M(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, i):
            x, y = batch
            return torch.nn.functional.mse_loss(self.lin(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.01)

    def fit(loader, root):
        L.Trainer(max_epochs=2, logger=False, enable_checkpointing=False, default_root_dir=str(root),
                  enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
                  devices=1).fit(M(), loader)

    me = psutil.Process()
    before = {c.pid for c in me.children(recursive=True)}
    for cls in (torch.utils.data.DataLoader, DataLoader):
        loader = cls(ds, batch_size=8, num_workers=2, persistent_workers=True)
        try:
            for run in range(2):
                fit(loader, tmp_path / f"{cls.__module__}{run}")
                left = {c.pid for c in me.children(recursive=True) if c.is_running()
                        and c.status() != psutil.STATUS_ZOMBIE} - before
                assert not left, (cls, run, left)
        finally:
            if hasattr(loader, "close"):
                loader.close()


def _fit_and_record(make_loader, root, ckpt=None, *, every_n_train_steps=1, **trainer_kw) -> list:
    """Seed (``seed_everything(0)``), then train a one-weight model on CPU over the batches of sample
    indices of ``make_loader()``, saving a checkpoint every ``every_n_train_steps`` steps into ``root``
    (``step=N.ckpt``) and resuming from ``ckpt`` when given; ``trainer_kw``: the Trainer's run length
    (``max_epochs``, ``limit_train_batches``). The loader is closed afterwards (torch's has no close).
    Returns what each training step was given: (epoch, batch index, the batch's indices)."""
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Recorder(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin, self.seen = torch.nn.Linear(1, 1), []

        def training_step(self, batch, i):
            self.seen.append((self.current_epoch, i, batch.flatten().tolist()))
            return self.lin(batch.float()).sum()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), 0.01)

    L.seed_everything(0, verbose=False)
    loader = make_loader()
    m = Recorder()
    saves = ModelCheckpoint(dirpath=str(root), every_n_train_steps=every_n_train_steps, save_top_k=-1,
                            filename="{step}")
    L.Trainer(callbacks=[saves], logger=False, default_root_dir=str(root), enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu", devices=1, **trainer_kw).fit(m, loader, ckpt_path=ckpt)
    if hasattr(loader, "close"):
        loader.close()
    return m.seen


def test_a_checkpoint_at_an_epochs_last_batch_resumes_at_the_next_epoch_as_torch_s(tmp_path):
    """Lightning saves a loader's ``state_dict()`` in every checkpoint and loads it on resume
    (``_FitLoop.on_save_checkpoint`` / ``_load_combined_loader_states``). A checkpoint taken at an
    epoch's last batch (``ModelCheckpoint(every_n_train_steps=...)`` landing there) held "epoch 0, all
    4 batches delivered": its fetcher knows the length and never asked for the ``StopIteration``.
    Lightning counts that epoch done and starts the next, which the loader resumed as the rest of
    epoch 0, nothing: 4 batches trained where torch's loader trains 8, a whole epoch lost. Now that
    state resumes at the next epoch (as torchdata's StatefulDataLoader does): the run trains epochs 1
    and 2, each sample once an epoch, epoch 1 the uninterrupted run's; and a mid-epoch checkpoint still
    resumes at its next batch (torch's loader, without state, restarts the epoch from a new order)."""
    import torch.utils.data as tud

    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    def fit(cls, root, ckpt=None):
        return _fit_and_record(lambda: cls(Indexed(16), batch_size=4, shuffle=True, num_workers=1), root, ckpt,
                               every_n_train_steps=2, max_epochs=3)

    def epochs(seen):
        return [e for e, _, _ in seen]

    full = fit(DataLoader, tmp_path / "full")
    assert epochs(full) == [0] * 4 + [1] * 4 + [2] * 4
    at_end = fit(DataLoader, tmp_path / "end", ckpt=tmp_path / "full" / "step=4.ckpt")
    fit(tud.DataLoader, tmp_path / "torch_full")      # torch's loader has no state in its checkpoints
    torch_at_end = fit(tud.DataLoader, tmp_path / "torch", ckpt=tmp_path / "torch_full" / "step=4.ckpt")
    assert epochs(at_end) == epochs(torch_at_end) == [1] * 4 + [2] * 4, (at_end, torch_at_end)
    for e in (1, 2):
        assert sorted(v for ep, _, b in at_end if ep == e for v in b) == list(range(16)), at_end
    assert at_end[:4] == full[4:8]                  # epoch 1 as the uninterrupted run's
    mid = fit(DataLoader, tmp_path / "mid", ckpt=tmp_path / "full" / "step=2.ckpt")
    assert mid[:2] == full[2:4], (mid, full)        # the rest of epoch 0, exactly once
    assert epochs(mid) == [0] * 2 + [1] * 4 + [2] * 4


@pytest.mark.parametrize("num_workers", [0, 1])
def test_limit_train_batches_resume_from_any_step_trains_the_uninterrupted_runs_batches(tmp_path, num_workers):
    """``limit_train_batches=5`` of 8: Lightning ends each epoch at its 5th batch, before the sampler
    does. A checkpoint there held "epoch 0, 5 batches delivered", which Lightning counts as a finished
    epoch; the loader resumed it as the rest of epoch 0, so the resumed epoch 1 trained epoch 0's
    batches 5-7 (never trained by the uninterrupted run) and stopped after 3. Now the loader reads
    Lightning's own word (``is_last_batch``) when its state is loaded and resumes at the next epoch, with
    the generator where the run's left it: from every checkpoint, mid-epoch or at a limited epoch's end,
    the resumed run trains the uninterrupted run's remaining batches, in its order. The uninterrupted
    run equals torch's loader's."""
    import torch
    import torch.utils.data as tud

    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    def fit(cls, root, ckpt=None):
        return _fit_and_record(lambda: cls(Indexed(32), batch_size=4, shuffle=True, num_workers=num_workers,
                                           generator=torch.Generator().manual_seed(1)),
                               root, ckpt, max_epochs=3, limit_train_batches=5)

    full = fit(DataLoader, tmp_path / "full")
    assert [e for e, _, _ in full] == [0] * 5 + [1] * 5 + [2] * 5
    assert full == fit(tud.DataLoader, tmp_path / "torch")
    for step in (2, 5, 7, 10):
        resumed = fit(DataLoader, tmp_path / f"from{step}", ckpt=tmp_path / "full" / f"step={step}.ckpt")
        assert resumed == full[step:], (step, resumed, full[step:])


@pytest.mark.parametrize("num_workers", [0, 1])
def test_a_batch_sampler_without_len_trains_as_torch_s_and_resumes_mid_epoch_at_the_batch_lightning_left(
        tmp_path, num_workers):
    """A custom ``batch_sampler`` without ``__len__`` (an iterable of index lists): ``len(loader)`` raises
    TypeError as torch's does, so Lightning's ``_PrefetchDataFetcher`` fetches one batch ahead of the
    training step. The loader's state in a mid-epoch checkpoint counted that batch as delivered, and the
    resumed run skipped it (trained by neither run). Now the loader resumes at the batch Lightning
    trains next (its ``batch_progress``). The uninterrupted run equals torch's loader's; resumed from any
    step it trains the uninterrupted run's remaining batches of that epoch."""
    import torch
    import torch.utils.data as tud

    from adloader import DataLoader
    from tests.loader_datasets import Indexed

    class Batches:
        def __iter__(self):
            order = torch.randperm(24).tolist()        # torch's global generator: seed_everything
            for i in range(0, 24, 3):
                yield order[i:i + 3]

    def without_len(cls):
        loader = cls(Indexed(24), batch_sampler=Batches(), num_workers=num_workers)
        with pytest.raises(TypeError):
            len(loader)
        return loader

    def fit(cls, root, ckpt=None):
        return _fit_and_record(lambda: without_len(cls), root, ckpt, max_epochs=1)

    full = fit(DataLoader, tmp_path / "full")
    assert len(full) == 8 and full == fit(tud.DataLoader, tmp_path / "torch")
    for step in (1, 3, 6):
        resumed = fit(DataLoader, tmp_path / f"from{step}", ckpt=tmp_path / "full" / f"step={step}.ckpt")
        assert resumed == full[step:], (step, resumed, full[step:])
