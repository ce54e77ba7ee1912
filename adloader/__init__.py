"""A-Dloader client side: the elastic drop-in ``DataLoader`` and the agent client.

``import adloader`` must work with only pyzmq and psutil installed (the node agent imports the
wire protocol from here); torch is imported only when ``adloader.DataLoader`` is first used.
"""
from __future__ import annotations

__version__ = "0.1.0"

__all__ = ["DataLoader", "__version__"]


def __getattr__(name: str):
    if name == "DataLoader":
        from adloader.dataloader import DataLoader

        return DataLoader
    raise AttributeError(f"module 'adloader' has no attribute {name!r}")
