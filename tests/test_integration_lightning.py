"""Lightning: the loader built in the hook (adloader first imported there, after Lightning), passed to `fit`, and `num_workers="auto"`; no integration module, with the real framework on CPU (1 process, and 2 over gloo with a live agent). The
framework tier: `-m frameworks` selects it; it skips with the reason where the framework is absent
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
