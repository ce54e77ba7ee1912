"""The node's loader memory budget in force, tick by tick: the configured budget, lowered under pressure.

``MemoryGuard.update(now, loader_used) -> MemoryState`` reads the node's memory (an injectable
``source``, default ``adloader.memory.node_memory``: ``/proc/meminfo`` and ``/proc/pressure/memory``,
read only) and decides the budget the policy must plan within this tick:

- pressure is PSI memory "some" at or above ``psi_threshold`` percent, measured over the last tick
  from PSI's cumulative stall counter (``total``, microseconds: it reacts at once and stops the moment
  the stalls stop, where ``avg10`` lags ten seconds and would keep asking for cuts already made; avg10
  is used for the first reading only), or ``MemAvailable`` below ``min_available``;
- under pressure the budget in force becomes what the loaders use now minus what must be freed: the
  shortfall of MemAvailable below ``min_available``, and at least ``shrink_frac`` (25%) of the loaders'
  memory. Each tick that still sees pressure cuts again from what is used then, so a cut that was not
  enough is followed by another within a tick. The policy takes the workers away where the least
  GPU-weighted throughput is lost per byte freed (``agent.policies.memory_caps``);
- once the pressure is gone, the cut is held for ``clear_ticks`` (3) ticks, then grows back one step
  per tick: ``grow_frac`` (10%) of what the loaders held when the pressure began (the pre-pressure
  plan), so workers come back a few at a time and a plan that brought the pressure on is not
  restored in one jump (which could bring it straight back). A step is taken only while the pressure
  stays low: PSI under half the threshold and MemAvailable above ``min_available`` plus the step;
  otherwise the cut is held and the note says why. When the cut reaches the pre-pressure use (or the
  configured budget) it is lifted and the configured budget is in force again. Pressure during the
  growth cuts again at once, from what is used then; the shrink is never slowed by the growth.

Every change of state is logged (``memory_pressure``, ``memory_pressure_easing`` at each step,
``memory_pressure_cleared``) and the current one is in ``MemoryState.note``, which the policy puts in
the reasons of the jobs whose workers it holds back and ``adloader status`` shows. Nothing here writes
anywhere: memory is acted on through worker counts only.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Optional

from adloader import memory as memmod
from adloader.memory import NodeMemory, format_bytes
from agent import logs

log = logging.getLogger("agent.memory")


@dataclass(frozen=True)
class MemoryState:
    budget: Optional[float]              # in force this tick (None = no budget)
    configured: Optional[float]          # the configured budget (None = off)
    used: float                          # the loaders' memory now (sum of the jobs' reports)
    available: Optional[float]           # MemAvailable
    pressure_pct: Optional[float]        # PSI memory some, over the last tick (avg10 at first)
    under_pressure: bool
    note: str = ""

    def to_dict(self) -> dict:
        return {"budget_bytes": self.budget, "configured_bytes": self.configured, "used_bytes": self.used,
                "available_bytes": self.available, "pressure_pct": self.pressure_pct,
                "under_pressure": self.under_pressure, "note": self.note}


class MemoryGuard:
    def __init__(self, budget: Optional[float], *, psi_threshold: float = 10.0, min_available: float = 256 << 20,
                 source: Callable[[], NodeMemory] = memmod.node_memory, clear_ticks: int = 3,
                 shrink_frac: float = 0.25, grow_frac: float = 0.1) -> None:
        if not 0 < grow_frac <= 1:
            raise ValueError(f"MemoryGuard.grow_frac must be in (0, 1], got {grow_frac}")
        self.configured = budget
        self.psi_threshold = psi_threshold
        self.min_available = min_available
        self.source = source
        self.clear_ticks = clear_ticks
        self.shrink_frac = shrink_frac
        self.grow_frac = grow_frac
        self.cap: Optional[float] = None         # the cut in force (None = none)
        self.before = 0.0                        # the loaders' memory when the pressure began (restore target)
        self.quiet = 0
        self._prev: Optional[tuple[float, int]] = None    # (now, PSI some total µs)
        self.state = MemoryState(budget, budget, 0.0, None, None, False)

    def _pressure_pct(self, now: float, node: NodeMemory) -> Optional[float]:
        pct = node.some_avg10
        if node.some_total_us is not None:
            prev, self._prev = self._prev, (now, node.some_total_us)
            if prev is not None and now > prev[0] and node.some_total_us >= prev[1]:
                pct = min(100.0, (node.some_total_us - prev[1]) / 1e6 / (now - prev[0]) * 100.0)
        return pct

    def update(self, now: float, loader_used: float) -> MemoryState:
        try:
            node = self.source()
        except Exception as e:   # noqa: BLE001 — a failing reading never stops the tick
            log.debug("memory source failed: %s", e)
            node = NodeMemory(None, None)
        pct = self._pressure_pct(now, node)
        why = []
        if pct is not None and pct >= self.psi_threshold:
            why.append(f"PSI memory some {pct:.0f}% >= {self.psi_threshold:g}%")
        if node.available is not None and node.available < self.min_available:
            why.append(f"MemAvailable {format_bytes(node.available)} < {format_bytes(self.min_available)}")
        note = ""
        if why:
            short = (self.min_available - node.available) if node.available is not None else 0.0
            to_free = max(short, self.shrink_frac * loader_used)
            cut = max(0.0, loader_used - to_free)
            first = self.cap is None
            if first:
                self.before = loader_used
            self.cap = cut if first else min(self.cap, cut)
            self.quiet = 0
            note = (f"memory pressure ({'; '.join(why)}): loader memory cut to {format_bytes(self.cap)} "
                    f"from {format_bytes(loader_used)} in use")
            logs.event(log, "memory_pressure", logging.WARNING, detail=note, pressure_pct=pct,
                       available_bytes=node.available, loader_used_bytes=loader_used, budget_bytes=self.cap,
                       first=first)
        elif self.cap is not None:
            note = self._ease(pct, node)
        budget = self.configured
        if self.cap is not None:
            budget = self.cap if budget is None else min(budget, self.cap)
        self.state = MemoryState(budget, self.configured, loader_used, node.available, pct, bool(why), note)
        return self.state

    def _ease(self, pct: Optional[float], node: NodeMemory) -> str:
        """A tick without pressure while a cut is in force: hold it, grow it one step, or lift it."""
        self.quiet += 1
        target = self.before if self.configured is None else min(self.configured, self.before)
        if self.quiet <= self.clear_ticks:
            return (f"memory pressure gone {self.quiet} tick(s) ago: loader memory held at "
                    f"{format_bytes(self.cap)}; it grows back after {self.clear_ticks} quiet ticks")
        step = max(1.0, self.grow_frac * target)
        low = []
        if pct is not None and pct >= self.psi_threshold / 2:
            low.append(f"PSI memory some {pct:.0f}% >= {self.psi_threshold / 2:g}%")
        if node.available is not None and node.available < self.min_available + step:
            low.append(f"MemAvailable {format_bytes(node.available)} < {format_bytes(self.min_available + step)}")
        if low:
            return (f"memory pressure eased but not low ({'; '.join(low)}): loader memory held at "
                    f"{format_bytes(self.cap)}")
        self.cap += step
        if self.cap >= target - 1.0:
            logs.event(log, "memory_pressure_cleared",
                       detail=f"no memory pressure for {self.quiet} ticks: loader memory back to "
                              f"{format_bytes(target)} (its use before the pressure); budget "
                              f"{format_bytes(self.configured) if self.configured is not None else 'none'} in force")
            self.cap = None
            self.quiet = 0
            self.before = 0.0
            return ""
        note = (f"memory pressure gone {self.quiet} ticks: loader memory growing back by {format_bytes(step)} a tick, "
                f"now {format_bytes(self.cap)} of {format_bytes(target)} before the pressure")
        logs.event(log, "memory_pressure_easing", detail=note, budget_bytes=self.cap, target_bytes=target)
        return note
