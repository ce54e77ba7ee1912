"""GPU utilisation from NVML (``nvidia-ml-py`` provides the ``pynvml`` module), behind one small class.

``GpuSampler.sample(now)`` polls once per tick: device utilisation (``nvmlDeviceGetUtilizationRates``)
for every device, and per-process SM utilisation (``nvmlDeviceGetProcessUtilization``) where the
driver gives it. That call raises ``NVMLError_NotFound`` when there is no sample newer than the
timestamp passed in: then the previous per-process figures are carried forward (DESIGN "NVML").
``job_idle_frac(gpus, pids)`` -> fraction of time the job's GPUs were idle, or None when unknown.

Without a driver ``nvmlInit`` fails fast: the agent says so once and retries with backoff
(``RETRY_S`` doubling to ``RETRY_MAX_S``), running on client-reported figures meanwhile.

One device failing (``NVMLError_GpuIsLost`` after an Xid 79, ``NotSupported``, ``NoPermission`` for a
device another container owns) costs that device only: a handle NVML refuses at init leaves it out,
and a device whose utilisation read fails in a tick has no figures that tick (its jobs fall back to
the clients' data-wait figures, as without NVML) while the others are sampled as usual; each device's
error is said once. Only when every device fails (the driver went away) is NVML taken as lost and
initialised again with backoff. ``device_errors``: index -> the last error of a device not sampled.
Tests pass a fake module with the same functions (``module=``).
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from agent import logs

log = logging.getLogger("agent.nvml")

RETRY_S = 5.0
RETRY_MAX_S = 300.0


class GpuSampler:
    def __init__(self, module: Any = None):
        self._module = module
        self._nv: Any = None
        self.available = False
        self._next_try = 0.0
        self._retry_s = RETRY_S
        self._handles: dict[str, Any] = {}        # "0" / "GPU-uuid" -> handle
        self._index_of: dict[str, str] = {}       # uuid -> index string
        self.device_util: dict[str, float] = {}   # index string -> percent
        self.process_util: dict[str, dict[int, float]] = {}   # index -> pid -> SM percent
        self._last_ts: dict[str, int] = {}
        self.last_error = ""
        self.device_errors: dict[str, str] = {}  # index -> why it has no figures now (status, logs)

    def _init(self, now: float) -> None:
        if self.available or now < self._next_try:
            return
        try:
            nv = self._module
            if nv is None:
                import pynvml as nv   # nvidia-ml-py
            nv.nvmlInit()
            handles, index_of = {}, {}
            errors = {}
            for i in range(nv.nvmlDeviceGetCount()):
                try:
                    h = nv.nvmlDeviceGetHandleByIndex(i)
                except nv.NVMLError as e:      # this device only (lost, not ours): the others still work
                    errors[str(i)] = f"{type(e).__name__}: {e}"
                    self._device_failed(str(i), errors[str(i)])
                    continue
                handles[str(i)] = h
                try:
                    uuid = nv.nvmlDeviceGetUUID(h)
                    uuid = uuid.decode() if isinstance(uuid, bytes) else str(uuid)
                    handles[uuid] = h
                    index_of[uuid] = str(i)
                except Exception:
                    pass
            if errors and not handles:
                raise nv.NVMLError(f"no device answered: {errors}")
            self._nv, self._handles, self._index_of = nv, handles, index_of
            self.device_errors = errors
            self.available = True
            self._retry_s = RETRY_S
            logs.event(log, "nvml_ready", devices=sum(1 for k in handles if k.isdigit()))
        except Exception as e:   # no driver, no library, no permission: all the same here
            self.last_error = f"{type(e).__name__}: {e}"
            logs.once("nvml_unavailable", log, "nvml_unavailable", logging.WARNING, error=self.last_error,
                      detail="no NVIDIA driver: GPU idle is taken from the clients' data-wait figures; "
                             "retrying NVML with backoff")
            self._next_try = now + self._retry_s
            self._retry_s = min(RETRY_MAX_S, self._retry_s * 2)

    def sample(self, now: float) -> None:
        self._init(now)
        if not self.available:
            return
        nv = self._nv
        try:
            devices = [k for k in self._handles if k.isdigit()]
            failed: dict[str, str] = {}
            for key in devices:
                h = self._handles[key]
                try:
                    self.device_util[key] = float(nv.nvmlDeviceGetUtilizationRates(h).gpu)
                except nv.NVMLError as e:
                    # this device only: no figures for it this tick (stale ones would read as current)
                    failed[key] = f"{type(e).__name__}: {e}"
                    self.device_util.pop(key, None)
                    self.process_util.pop(key, None)
                    continue
                try:
                    samples = nv.nvmlDeviceGetProcessUtilization(h, self._last_ts.get(key, 0))
                except nv.NVMLError_NotFound:
                    continue   # no new sample: carry the previous figures forward
                except nv.NVMLError:
                    continue   # not supported on this device/driver: device utilisation only
                per_pid: dict[int, float] = {}
                ts = self._last_ts.get(key, 0)
                for s in samples:
                    per_pid[int(s.pid)] = float(s.smUtil)
                    ts = max(ts, int(s.timeStamp))
                self.process_util[key] = per_pid
                self._last_ts[key] = ts
            if devices and len(failed) == len(devices):
                raise nv.NVMLError(f"every device failed: {failed}")
            for key, why in failed.items():
                if self.device_errors.get(key) != why:
                    self._device_failed(key, why)
            for key in [k for k in self.device_errors if k in self._handles and k not in failed]:
                logs.event(log, "nvml_device_back", device=key)
                del self.device_errors[key]
            self.device_errors.update(failed)
        except Exception as e:
            self.available = False
            self.last_error = f"{type(e).__name__}: {e}"
            logs.event(log, "nvml_lost", logging.WARNING, error=self.last_error)
            self._next_try = now + self._retry_s

    def _device_failed(self, key: str, why: str) -> None:
        logs.event(log, "nvml_device_failed", logging.WARNING, device=key, error=why,
                   detail="this GPU has no NVML figures (its jobs use the clients' data-wait figures); "
                          "the other GPUs are sampled as usual")

    def _index(self, gpu: str) -> Optional[str]:
        if gpu in self._index_of:
            return self._index_of[gpu]
        return gpu if gpu in self._handles and gpu.isdigit() else None

    def job_idle_frac(self, gpus, pids) -> Optional[float]:
        """Idle fraction of the job's GPUs: from its own processes' SM utilisation when the driver
        reports it, else from whole-device utilisation (which other jobs on a shared GPU inflate)."""
        if not self.available:
            return None
        devs = [d for d in (self._index(g) for g in gpus) if d is not None and d in self.device_util]
        if not devs:
            return None
        pidset = set(pids)
        busy = []
        per_process = False
        for d in devs:
            pu = self.process_util.get(d)
            if pu and pidset & set(pu):
                per_process = True
                busy.append(min(100.0, sum(v for p, v in pu.items() if p in pidset)))
            else:
                busy.append(self.device_util[d])
        idle = 1.0 - (sum(busy) / len(busy)) / 100.0
        return min(1.0, max(0.0, idle)) if per_process or busy else None
