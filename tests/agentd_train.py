"""A real training process for the agent/client component tests: adloader.DataLoader over the
synthetic JPEG dataset, an emulated GPU step, and (under torchrun) torch.distributed with gloo and an
all-reduce per step. Run as ``python -m tests.agentd_train STATE_FILE RUN_S WORKERS STEP_S``; it writes
the agent client's state, the loader's worker count and pids to STATE_FILE every 0.1 s. With
``TRAIN_STREAM=1`` the loader reads an endless IterableDataset over the same images instead."""
from __future__ import annotations

import json
import os
import sys
import time


def main() -> int:
    state_file, run_s, workers, step_s = sys.argv[1], float(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
    import torch

    from adloader import DataLoader, client
    from adloader.synthetic import SyntheticImageDataset, emulated_step

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    ds = SyntheticImageDataset(num_images=16, image_px=64, crop_px=32, length=1_000_000, seed=rank)
    if os.environ.get("TRAIN_STREAM"):      # an endless IterableDataset (a stream: its epoch never ends)
        import itertools

        images = ds

        class Stream(torch.utils.data.IterableDataset):
            def __iter__(self):
                return (images[i % 64] for i in itertools.count())

        ds = Stream()
    loader = DataLoader(ds, batch_size=4, num_workers=workers, max_workers=4, persistent_workers=True)
    if world > 1:
        state_file = f"{state_file}.{rank}"
    t_end = time.monotonic() + run_s
    last_write = 0.0
    steps = 0
    for batch in loader:
        emulated_step(batch, step_s)
        if world > 1:
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == world
        steps += 1
        now = time.monotonic()
        if now - last_write > 0.1:
            st = dict(client.state())
            st.update(num_workers=loader.num_workers, worker_pids=loader.worker_pids(), steps=steps)
            with open(state_file + ".tmp", "w") as f:
                json.dump(st, f)
            os.replace(state_file + ".tmp", state_file)
            last_write = now
        if now > t_end:
            break
    loader.close()
    if world > 1:
        dist.destroy_process_group()
    print(f"rank {rank} done after {steps} steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())
