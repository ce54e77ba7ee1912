"""The transformers ``Trainer`` with its loaders built as ``adloader.DataLoader``.

The Trainer builds torch's ``DataLoader`` itself and hands it to ``accelerator.prepare``
(``transformers/trainer.py``, ``Trainer._get_dataloader``), so A-Dloader cannot get in from outside;
and ``TrainingArguments(dataloader_num_workers="auto")`` is refused by transformers' own checks. Use
this Trainer (or put the mixin before your own Trainer subclass):

    from adloader.integrations.transformers import Trainer
    trainer = Trainer(model=model, args=args, train_dataset=ds, adloader_num_workers="auto")

The Trainer builds and prepares each loader as usual (its sampler, collator, worker seeding,
Accelerate's per-process sharding), then the torch loader inside the prepared wrapper is replaced by
an ``adloader.DataLoader`` with the same arguments (``adloader.integrations.accelerate.adloader_base``).
``adloader_num_workers``: an int or ``"auto"`` (default: ``args.dataloader_num_workers``);
``adloader_max_workers``: the loader's ``max_workers``. The loaders built so far are in
``trainer.adloader_loaders`` ({"train": ..., "eval": ..., "test": ...}), live handles for ``stats()``
and ``resize()``.

A run resumed mid-epoch (``train(resume_from_checkpoint=...)``) skips the batches already trained with
Accelerate's ``skip_first_batches``, which builds a new torch loader (``Trainer._inner_training_loop``):
the resumed epoch ran on torch's DataLoader. During ``train()`` the name ``skip_first_batches`` in
``transformers.trainer`` is ``adloader.integrations.accelerate.skip_first_batches``, which keeps an
``adloader.DataLoader`` inside (sharing the train loader's state) and passes any other loader to
Accelerate's function unchanged.

The Trainer knows how long it trains (``state.max_steps``): at the start of ``train()`` the train
loader is told the batches left (``max_steps`` less the steps done, times the gradient accumulation:
``DataLoader.set_total_steps``), which the node agent's finish guard uses; the hint is withdrawn
when training ends.
"""
from __future__ import annotations

import transformers

from adloader.dataloader import DataLoader
from adloader.integrations.accelerate import adloader_base, skip_first_batches

__all__ = ["AdloaderTrainerMixin", "Trainer"]


class AdloaderTrainerMixin:
    """Put before ``transformers.Trainer`` (or a subclass of it) in the bases."""

    def __init__(self, *args, adloader_num_workers=None, adloader_max_workers=None, **kwargs):
        if adloader_num_workers is not None and adloader_num_workers != "auto" and (
                isinstance(adloader_num_workers, bool) or not isinstance(adloader_num_workers, int)
                or adloader_num_workers < 0):
            raise ValueError(f"adloader_num_workers must be an int >= 0 or 'auto', got {adloader_num_workers!r}")
        self.adloader_num_workers = adloader_num_workers
        self.adloader_max_workers = adloader_max_workers
        self.adloader_loaders: dict[str, DataLoader] = {}
        super().__init__(*args, **kwargs)
        self.add_callback(_StepsLeft(self))

    def _adloader(self, prepared, key: str):
        n = self.adloader_num_workers
        if n is None:
            n = self.args.dataloader_num_workers
        loader = adloader_base(prepared, num_workers=n, max_workers=self.adloader_max_workers)
        old = self.adloader_loaders.get(key)
        if old is not None and old is not loader:
            old.close()          # a loader the Trainer rebuilt (each evaluation, a new train() call)
        self.adloader_loaders[key] = loader
        return prepared

    def train(self, *args, **kwargs):
        """``Trainer.train``, with the resumed epoch's loader kept an ``adloader.DataLoader`` (see the
        module docstring)."""
        import transformers.trainer as hf_trainer

        original = hf_trainer.skip_first_batches
        hf_trainer.skip_first_batches = skip_first_batches
        try:
            return super().train(*args, **kwargs)
        finally:
            if hf_trainer.skip_first_batches is skip_first_batches:
                hf_trainer.skip_first_batches = original

    def get_train_dataloader(self):
        return self._adloader(super().get_train_dataloader(), "train")

    def get_eval_dataloader(self, eval_dataset=None):
        key = eval_dataset if isinstance(eval_dataset, str) else "eval"
        return self._adloader(super().get_eval_dataloader(eval_dataset), key)

    def get_test_dataloader(self, test_dataset):
        return self._adloader(super().get_test_dataloader(test_dataset), "test")


class _StepsLeft(transformers.TrainerCallback):
    """Tells the train loader how many batches the run has left (``set_total_steps``)."""

    def __init__(self, trainer: AdloaderTrainerMixin):
        self.trainer = trainer

    def _loader(self):
        loader = self.trainer.adloader_loaders.get("train")
        return loader if isinstance(loader, DataLoader) else None

    def on_train_begin(self, args, state, control, **kwargs):
        loader = self._loader()
        if loader is not None and state.max_steps and state.max_steps > 0:
            left = (state.max_steps - state.global_step) * max(1, args.gradient_accumulation_steps)
            loader.set_total_steps(max(0, int(left)))

    def on_train_end(self, args, state, control, **kwargs):
        loader = self._loader()
        if loader is not None:
            loader.set_total_steps(None)


class Trainer(AdloaderTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` whose loaders are ``adloader.DataLoader`` (see the module docstring)."""
