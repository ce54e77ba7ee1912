"""A-Dloader client side: the elastic drop-in ``DataLoader`` and the agent client.

``adloader.DataLoader`` is created when ``adloader`` is imported, so that a framework that patches
the ``__init__`` of every ``torch.utils.data.DataLoader`` subclass it finds (Lightning does, around
its dataloader hooks) finds this one, whenever the user's script imports it.

Two kinds of process import this package without wanting torch:
- the node agent (the ``agent`` package), which imports the torch-free modules ``adloader.protocol``,
  ``adloader.env`` (and the predictor): ``agent/__init__.py`` sets ``TORCH_FREE = True`` before it
  imports anything from here, and then this package does not import torch at all;
- any process where torch is not installed: ``adloader.protocol`` and friends import, and
  ``adloader.DataLoader`` raises an ImportError that says so.
"""
from __future__ import annotations

import sys

__version__ = "0.1.0"

__all__ = ["DataLoader", "__version__"]


def _torch_free_process() -> bool:
    return bool(getattr(sys.modules.get("agent"), "TORCH_FREE", False))


_import_error: ImportError | None = None
if not _torch_free_process():
    try:
        from adloader.dataloader import DataLoader
    except ImportError as e:        # torch absent (or broken): the torch-free modules still import
        if e.name is None or e.name.split(".")[0] != "torch":
            raise
        _import_error = e


def __getattr__(name: str):
    # reached only where the eager import above did not run (the agent) or failed (no torch)
    if name == "DataLoader":
        if _import_error is not None:
            raise ImportError(f"adloader.DataLoader needs torch ({_import_error}); install torch, or the "
                              "project's [torch] extra") from _import_error
        from adloader.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'adloader' has no attribute {name!r}")
