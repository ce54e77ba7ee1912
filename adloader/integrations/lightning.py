"""``adloader.integrations.lightning``: ``StepsLeft``, a Lightning callback that tells the train
loaders how many batches the run has left (``DataLoader.set_total_steps``), for the node agent's
finish guard (docs/users.md, ``total_steps``)::

    from adloader.integrations.lightning import StepsLeft
    trainer = lightning.Trainer(..., callbacks=[StepsLeft()])

At ``on_train_start``: ``(estimated_stepping_batches - global_step) x accumulate_grad_batches`` (the
whole run's optimizer steps less those done, a resumed run's included, in batches), told to every
``adloader.DataLoader`` among the train dataloaders (one, or a list, tuple, dict or CombinedLoader
iterated together; Lightning's rebuilt copies share the count with the loader you built). Nothing
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
        left = (int(total) - trainer.global_step) * max(1, int(trainer.accumulate_grad_batches))
        for loader in _loaders(trainer.train_dataloader):
            loader.set_total_steps(max(0, left))

    def on_train_end(self, trainer, pl_module) -> None:
        for loader in _loaders(trainer.train_dataloader):
            loader.set_total_steps(None)
