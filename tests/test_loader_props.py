"""Property: whatever the resizes (when, to what), every sample arrives exactly once and the batches
equal torch's DataLoader(num_workers=0) for the same generator seed (real worker processes)."""
from __future__ import annotations

import pytest
import torch
import torch.utils.data as tud
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from adloader import DataLoader
from tests.loader_datasets import Indexed, RandomAug

pytestmark = [pytest.mark.component, pytest.mark.filterwarnings("ignore:This DataLoader will create")]

N = 60
resize_plans = st.lists(st.tuples(st.integers(0, 14), st.integers(0, 4)), max_size=5)


def _run(plan, *, start, method, batch_size, seed, shuffle, drop_last, in_order=True):
    dl = DataLoader(Indexed(N, sleep_s=0.0003), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                    generator=torch.Generator().manual_seed(seed), num_workers=start, max_workers=4,
                    multiprocessing_context=method if start > 0 else None, in_order=in_order)
    at = {}
    for step, n in plan:
        at.setdefault(step, []).append(n)
    out = []
    for step, b in enumerate(dl):
        out.append(b)
        for n in at.get(step, ()):
            dl.resize(n)
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=resize_plans, start=st.integers(0, 3), batch_size=st.integers(1, 7), seed=st.integers(0, 2**31),
       shuffle=st.booleans(), drop_last=st.booleans())
def test_exactly_once_in_torch_order_under_resizes_fork(plan, start, batch_size, seed, shuffle, drop_last):
    ref = list(tud.DataLoader(Indexed(N), batch_size=batch_size, shuffle=shuffle, drop_last=drop_last,
                              generator=torch.Generator().manual_seed(seed)))
    got = _run(plan, start=start, method="fork", batch_size=batch_size, seed=seed, shuffle=shuffle,
               drop_last=drop_last)
    assert len(got) == len(ref)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=resize_plans, start=st.integers(1, 3), batch_size=st.integers(1, 7), seed=st.integers(0, 2**31))
def test_exactly_once_out_of_order_mode(plan, start, batch_size, seed):
    got = _run(plan, start=start, method="fork", batch_size=batch_size, seed=seed, shuffle=True,
               drop_last=False, in_order=False)
    ids = torch.cat([b.flatten() for b in got]).tolist()
    assert sorted(ids) == list(range(N))


@settings(max_examples=2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=st.lists(st.tuples(st.integers(0, 10), st.integers(1, 3)), min_size=1, max_size=2),
       seed=st.integers(0, 2**31))
def test_exactly_once_in_torch_order_under_resizes_spawn(plan, seed):
    ref = list(tud.DataLoader(Indexed(N), batch_size=4, shuffle=True, generator=torch.Generator().manual_seed(seed)))
    got = _run(plan, start=1, method="spawn", batch_size=4, seed=seed, shuffle=True, drop_last=False)
    assert len(got) == len(ref) and all(torch.equal(a, b) for a, b in zip(got, ref))


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(plan=resize_plans, seed=st.integers(0, 2**31))
def test_augmentation_identical_whatever_the_resizes(plan, seed):
    def run(plan, start):
        dl = DataLoader(RandomAug(30), batch_size=3, shuffle=True, generator=torch.Generator().manual_seed(seed),
                        num_workers=start, max_workers=4)
        out = []
        for step, b in enumerate(dl):
            out.append((b["i"].tolist(), b["torch"].tolist(), b["py"].tolist(), b["np"].tolist()))
            for s, n in plan:
                if s == step:
                    dl.resize(n)
        return out

    assert run(plan, 2) == run([], 0)
