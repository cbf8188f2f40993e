"""Where the steps' time goes (LLM.timing, bench.py): each phase of a step timed on the host,
the device synchronised at every lap so that a phase's time is its own, or not synchronised,
so that steps overlap as they do untimed: then each phase is the host's own time, a step's
device work shows where the host waits for its tokens, and the phases still sum to the wall
time."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

# schedule: which sequences run, how many tokens, who evicts; describe: the step described to
# the tensor-parallel workers (nanokv/engine/workers.py); swap: blocks copied to and from
# the host tier; evict: copies of cached blocks and the eviction surgery; prepare: the step's
# inputs; forward: the model and the logits of the sampled rows (the device's work); sample:
# sampling and prompt logprobs; wait: the host waiting for a step's tokens and taking them;
# update: tokens recorded, stops checked, blocks freed; outputs: detokenizing, stop strings,
# RequestOutputs.
PHASES = ("schedule", "describe", "swap", "evict", "prepare", "forward", "sample", "wait", "update", "outputs")
DEVICE_PHASES = ("forward", "wait")   # not the host's own work


def _zeros() -> dict[str, float]:
    return dict.fromkeys(PHASES, 0.0)


@dataclass
class Timings:
    """Seconds per phase over the steps timed, by kind of step: decode (one token for every
    sequence) or prefill (any prompt chunk, mixed steps too); synchronized: the device was
    synchronised at every lap."""
    decode: dict[str, float] = field(default_factory=_zeros)
    prefill: dict[str, float] = field(default_factory=_zeros)
    decode_steps: int = 0
    prefill_steps: int = 0
    synchronized: bool = True

    def host_s(self, kind: str) -> float:
        """The engine's own time in steps of that kind: all but the forward pass and the wait for
        its tokens. Synchronized, that is what a GPU waits for."""
        phases = getattr(self, kind)
        return sum(phases.values()) - sum(phases[p] for p in DEVICE_PHASES)


class StepClock:
    """The laps of one step, added to timings when it ends; with timings None it does nothing."""

    def __init__(self, timings: Timings | None, device: torch.device):
        self.timings, self.device = timings, device
        self.laps = _zeros()
        self.last = self._now() if timings is not None else 0.0

    def _now(self) -> float:
        if self.device.type == "cuda" and self.timings.synchronized:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def lap(self, phase: str) -> None:
        """The time since the last lap was spent in phase."""
        if self.timings is not None:
            now = self._now()
            self.laps[phase] += now - self.last
            self.last = now

    def end(self, decode: bool, launched: bool = True) -> None:
        """The step's laps added to its kind's; one that launched nothing (it only read the
        tokens of the step before) adds its time but no step."""
        if self.timings is None:
            return
        kind = "decode" if decode else "prefill"
        totals = getattr(self.timings, kind)
        for phase, seconds in self.laps.items():
            totals[phase] += seconds
        setattr(self.timings, f"{kind}_steps", getattr(self.timings, f"{kind}_steps") + launched)
