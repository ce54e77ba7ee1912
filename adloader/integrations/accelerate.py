"""Accelerate: keep ``adloader.DataLoader`` inside the loader Accelerate trains on.

``accelerator.prepare(loader)`` builds a ``DataLoaderShard`` (or ``DataLoaderDispatcher``) around a
new ``torch.utils.data.DataLoader`` made from the loader's attributes plus Accelerate's per-process
batch sampler (``accelerate/data_loader.py``, ``prepare_data_loader``): the A-Dloader loader drops
out silently. ``prepare`` below lets Accelerate do all of that, then replaces the wrapper's inner
torch loader (``base_dataloader``) with an ``adloader.DataLoader`` built from the same arguments and
sharing the user's loader's ``elastic_state``:

    from adloader.integrations.accelerate import prepare
    model, optimizer, loader = prepare(accelerator, model, optimizer, loader)

The prepared object shards, places batches on the device and synchronises RNGs as Accelerate's own;
``prepared.stats()``/``resize()`` reach the A-Dloader loader (the wrapper forwards attributes), and
the user's original loader stays a live handle on the same workers and counters.

Resuming mid-epoch: ``accelerator.skip_first_batches(prepared, n)`` builds a new wrapper around a new
torch loader (``accelerate/data_loader.py``, ``skip_first_batches``), so the resumed epoch ran on
torch's DataLoader. ``skip_first_batches`` below does the same and keeps an ``adloader.DataLoader``
inside, sharing the prepared loader's elastic state:

    from adloader.integrations.accelerate import skip_first_batches
    for batch in skip_first_batches(prepared, n):     # instead of accelerator.skip_first_batches
"""
from __future__ import annotations

from typing import Any

import torch.utils.data as tud

from adloader import dataloader as _dl
from adloader.dataloader import DataLoader

__all__ = ["prepare", "adloader_base", "skip_first_batches"]


def prepare(accelerator, *objects: Any, device_placement=None):
    """``accelerator.prepare(*objects)``, with every ``adloader.DataLoader`` among them kept inside
    the prepared loader. Returns what ``accelerator.prepare`` returns (one object or a tuple)."""
    _dl._foreign_copy_allowed.on = True      # Accelerate reads the loader's attributes on purpose here
    try:
        out = accelerator.prepare(*objects, device_placement=device_placement)
    finally:
        _dl._foreign_copy_allowed.on = False
    prepared = out if isinstance(out, tuple) else (out,)
    for original, result in zip(objects, prepared):
        if isinstance(original, DataLoader) and result is not original:
            adloader_base(result, like=original)
    return out


def skip_first_batches(prepared, num_batches: int = 0):
    """``accelerate.skip_first_batches(prepared, num_batches)`` (what ``accelerator.skip_first_batches``
    and the transformers Trainer's resume call): the same wrapper skipping the same batches, with the
    torch loader it builds replaced by an ``adloader.DataLoader`` sharing the elastic state of the one
    inside ``prepared``. Any other loader is passed to Accelerate's function unchanged."""
    from accelerate.data_loader import skip_first_batches as accelerate_skip

    base = getattr(prepared, "base_dataloader", None)
    if not isinstance(base, DataLoader):
        return accelerate_skip(prepared, num_batches=num_batches)
    _dl._foreign_copy_allowed.on = True     # Accelerate reads the loader's attributes on purpose here
    try:
        out = accelerate_skip(prepared, num_batches=num_batches)
    finally:
        _dl._foreign_copy_allowed.on = False
    if out is not prepared and isinstance(getattr(out, "base_dataloader", None), tud.DataLoader):
        adloader_base(out, like=base)
    return out


def adloader_base(prepared, *, like: DataLoader | None = None, num_workers=None, max_workers=None) -> DataLoader:
    """Replace the torch loader inside an Accelerate-prepared loader (``prepared.base_dataloader``) with
    an ``adloader.DataLoader`` built from the same arguments, and return it. ``like``: the user's
    loader whose elastic state (workers, counters, agent attachment, ``"auto"``) the new one shares;
    without it, ``num_workers`` (an int or ``"auto"``) and ``max_workers`` start a new state."""
    base = getattr(prepared, "base_dataloader", None)
    if not isinstance(base, tud.DataLoader):
        raise TypeError(f"not an Accelerate-prepared DataLoader: {type(prepared).__name__} has no "
                        "torch base_dataloader (accelerate's StatefulDataLoader and XLA wrappers are not "
                        "supported)")
    if isinstance(base, DataLoader):
        return base
    if like is not None:
        num_workers = vars(like)["num_workers"]
        state = like.elastic_state
        max_workers = like.max_workers
    else:
        num_workers = base.num_workers if num_workers is None else num_workers
        state = None
    workers = num_workers == "auto" or num_workers > 0
    if isinstance(base.dataset, tud.IterableDataset) or base.batch_sampler is None:
        sampling = dict(batch_size=base.batch_size, drop_last=base.drop_last,
                        sampler=None if isinstance(base.dataset, tud.IterableDataset) else base.sampler)
    else:
        sampling = dict(batch_sampler=base.batch_sampler)
    prefetch = base.prefetch_factor if base.num_workers > 0 else (like.prefetch_factor if like is not None else None)
    loader = DataLoader(
        base.dataset, **sampling, num_workers=num_workers, collate_fn=base.collate_fn,
        pin_memory=base.pin_memory, timeout=base.timeout, worker_init_fn=base.worker_init_fn,
        multiprocessing_context=base.multiprocessing_context, generator=base.generator,
        prefetch_factor=prefetch if workers else None,
        persistent_workers=base.persistent_workers and workers,
        pin_memory_device=base.pin_memory_device, in_order=base.in_order,
        max_workers=max_workers, elastic_state=state)
    prepared.base_dataloader = loader
    if hasattr(prepared, "use_stateful_dataloader"):
        # what DataLoaderAdapter.__init__ does for a base loader that has state_dict()
        prepared.dl_state_dict = loader.state_dict()
    return loader
