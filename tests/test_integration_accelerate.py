"""Accelerate: `adloader.integrations.accelerate.prepare`, with the real framework on CPU (1 process, and 2 over gloo with a live agent). The
framework tier: `-m frameworks` selects it; it skips with the reason where the framework is absent
(`./run setup` installs the [frameworks] extra). What each run checks: tests/integration_train.py.
"""
from __future__ import annotations

import importlib.util

import pytest

from tests.integration_train import one_process, two_processes_with_agent

pytestmark = [pytest.mark.component, pytest.mark.frameworks,
              pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                 reason="accelerate is not installed (pip install -e '.[frameworks]' -c constraints-frameworks.txt)")]

RUNS = {"prepare": 2, "auto": 1}


def test_one_process(tmp_path):
    results = one_process("accelerate", RUNS, str(tmp_path))
    # accelerator.prepare(loader) without the integration: one warning naming the fix
    (warned,) = results[0]["plain_prepare_warnings"]
    assert "adloader.integrations.accelerate.prepare" in warned


def test_two_processes_gloo_with_a_live_agent(base, tmp_path):
    two_processes_with_agent("accelerate", RUNS, base, str(tmp_path))


def test_skip_first_batches_keeps_the_adloader_loader_for_the_resumed_epoch():
    """Accelerate's resume idiom, ``accelerator.skip_first_batches(prepared, n)``, builds a new wrapper
    around a new torch loader (``accelerate/data_loader.py``, ``skip_first_batches``): the resumed
    epoch ran on torch's DataLoader, no A-Dloader worker, no agent, the user's handle counting
    nothing (map-style: with a warning naming no fix; an IterableDataset behind
    ``dispatch_batches``: silently). ``adloader.integrations.accelerate.skip_first_batches`` skips
    the same batches with an ``adloader.DataLoader`` inside that shares the prepared loader's state;
    the batches are Accelerate's own, and a torch loader is passed through unchanged."""
    import warnings

    import torch
    import torch.utils.data as tud
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    from adloader import DataLoader
    from adloader.integrations.accelerate import prepare, skip_first_batches
    from tests.loader_datasets import Indexed

    class Stream(tud.IterableDataset):
        def __iter__(self):
            return (torch.tensor([i]) for i in range(38))

    def ids(loader):
        return [int(v) for b in loader for v in b.flatten()]

    for dispatch, make in ((False, lambda C: C(Indexed(38), batch_size=4, shuffle=True, num_workers=1,
                                              generator=torch.Generator().manual_seed(5))),
                           (True, lambda C: C(Stream(), batch_size=4, num_workers=1))):
        acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(dispatch_batches=dispatch))
        user = make(DataLoader)
        try:
            prepared = prepare(acc, user)
            reference = acc.skip_first_batches(acc.prepare(make(tud.DataLoader)), 3)
            with warnings.catch_warnings():
                warnings.simplefilter("error")          # no "rebuilding as torch's DataLoader" warning
                resumed = skip_first_batches(prepared, 3)
            assert type(resumed) is type(reference)
            assert isinstance(resumed.base_dataloader, DataLoader), type(resumed.base_dataloader)
            assert resumed.base_dataloader.elastic_state is user.elastic_state
            assert ids(resumed) == ids(reference) and len(ids(resumed)) == 38 - 12
            assert user.stats()["steps"] >= 7              # the resumed epoch counts on the user's handle
            passed = skip_first_batches(acc.prepare(make(tud.DataLoader)), 3)
            assert type(passed.base_dataloader) is tud.DataLoader
            assert ids(passed) == ids(acc.skip_first_batches(acc.prepare(make(tud.DataLoader)), 3))
        finally:
            user.close()
