"""``adloader.integrations.lightning``: ``StepsLeft``, a Lightning callback that tells the train
loaders how many batches the run has left (``DataLoader.set_total_steps``), for the node agent's
finish guard (docs/users.md, ``total_steps``)::

    from adloader.integrations.lightning import StepsLeft
    trainer = lightning.Trainer(..., callbacks=[StepsLeft()])

At ``on_train_start``: ``(estimated_stepping_batches - global_step) x accumulate_grad_batches`` (the
whole run's optimizer steps less those done, a resumed run's included, in batches), told to every
``adloader.DataLoader`` among the train dataloaders (one, or a list, tuple, dict or CombinedLoader
iterated together; Lightning's rebuilt copies share the count with the loader you built; in a
``CombinedLoader(mode="max_size")`` a shorter loader is told its own part). Nothing
when the run's length is unknown (an iterable of unknown length without ``max_steps``). Withdrawn at
``on_train_end``. Loading is Lightning's own: the loader needs no other glue (``adloader.DataLoader``'s
docstring, "Rebuilt by a framework").
"""
from __future__ import annotations

import math
from typing import Iterator

from lightning.pytorch import Callback

from adloader.dataloader import DataLoader


def _loaders(obj) -> Iterator[DataLoader]:
    """The ``adloader.DataLoader`` instances in a train dataloader collection."""
    if isinstance(obj, DataLoader):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _loaders(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _loaders(v)
    else:
        flattened = getattr(obj, "flattened", None)     # lightning's CombinedLoader
        if isinstance(flattened, list):
            for v in flattened:
                yield from _loaders(v)


class StepsLeft(Callback):
    """Tells the train loaders the batches the run has left (see the module docstring)."""

    def on_train_start(self, trainer, pl_module) -> None:
        total = trainer.estimated_stepping_batches
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total <= 0:
            return
        acc = max(1, int(trainer.accumulate_grad_batches))
        done = trainer.global_step * acc
        left = max(0, int(total) * acc - done)
        combined = getattr(trainer.fit_loop, "_combined_loader", None)
        if getattr(combined, "_mode", None) == "max_size":
            self._max_size(combined, done, left)
            return
        for loader in _loaders(trainer.train_dataloader):
            loader.set_total_steps(left)

    @staticmethod
    def _max_size(combined, done: int, left: int) -> None:
        """``CombinedLoader(mode="max_size")``: an epoch is as long as the longest iterable; a shorter
        one hands out its own length and then nothing until the next epoch. Each loader is told the
        batches it will hand out in the positions ``done .. done + left`` of the run (epochs of equal
        length from the start); one of unknown length, nothing."""
        try:
            epoch = len(combined)
        except TypeError:
            return
        if not epoch:
            return
        limits = combined.limits or [math.inf] * len(combined.flattened)
        for it, limit in zip(combined.flattened, limits):
            try:
                n = int(min(len(it), limit, epoch))   # limit: limit_train_batches, per iterable
            except TypeError:
                continue

            def handed(pos: int) -> int:   # an epoch of unknown length (inf): one partial epoch
                return int((pos // epoch) * n + min(pos % epoch, n))

            for loader in _loaders(it):
                loader.set_total_steps(handed(done + left) - handed(done))

    def on_train_end(self, trainer, pl_module) -> None:
        for loader in _loaders(trainer.train_dataloader):
            loader.set_total_steps(None)
