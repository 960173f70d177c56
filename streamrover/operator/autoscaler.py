"""Autoscaling from consumer lag: how many nodes a stream job needs, within MIN:MAX, with hysteresis and a cooldown.

Inputs, sampled by the controller from the master's status every few seconds:
``lag`` (records produced and not yet acked, summed over the job's stream datasets:
records, never position differences) and ``consumed`` (records acked so far, a counter).
From two samples the autoscaler knows the consumption rate ``C`` and the lag's slope,
hence the production rate ``P = C + dlag/dt`` (over the newest ``rate_window`` seconds, so a
step in the rate is seen whole at once), and the throughput of one node ``T = C / nodes``
(over ``window``; while nothing is consumed, as in a rendezvous after a scale decision, the
rate one node did when it was last busy). The nodes needed to keep up with ``P`` and drain the lag above the
target within ``drain_seconds`` are::

    needed = ceil((P + max(0, lag - target) / drain_seconds) / T)

A freshness target (seconds) becomes a lag target of ``freshness * P`` records.
Decisions, each with its inputs:

* **out** when the lag is above the target and ``needed`` > nodes (at most MAX), as soon
  as the rates are measured afresh at the current node count (a step up needs no cooldown:
  the lag is growing);
* **in**, in one decision, to the fewest nodes that keep up with the production measured over
  the whole calm period (not its newest seconds, which may hold one burst) at 90% of a busy
  node's rate, when the lag has stayed under half the target (hysteresis) for
  ``cooldown_seconds`` and not within ``cooldown_seconds`` of the previous decision (each
  scale-in is a rendezvous of the nodes that stay: one step pays one pause). With no lag, a
  node's measured rate is the supply, not what it can do: so "keep up" uses the per-node rate
  last measured while the lag was at least half the target (the nodes were busy); while no
  such rate was measured, one node fewer;
* never while the rates are unknown (under ``min(window / 2, 5 s)`` of samples since the
  node count last changed: a rendezvous pauses training).

The autoscaler only decides; the supervisor applies (``Supervisor.scale``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from streamrover.operator.spec import AutoscalingSpec


@dataclass(frozen=True)
class Sample:
    """One look at the job: when, the stream's lag and records consumed so far (records), and the nodes running."""
    at: float
    lag: int
    consumed: int
    nodes: int


@dataclass(frozen=True)
class Decision:
    """A scale decision and the inputs it was made from."""

    at: float
    nodes_from: int
    nodes_to: int
    lag: int
    target_lag: float
    produce_rate: float
    consume_rate: float
    per_node_rate: float
    needed: int
    why: str

    def describe(self) -> str:
        """The decision and the figures behind it, in one line (for events and logs)."""
        return (f"{self.why}: lag {self.lag:,} (target {self.target_lag:,.0f}), produced {self.produce_rate:,.0f}/s, "
                f"consumed {self.consume_rate:,.0f}/s ({self.per_node_rate:,.0f}/s per node), "
                f"needed {self.needed}")  # fmt: skip


@dataclass
class Autoscaler:
    """See the module docstring. ``window``: seconds of samples the rates are measured over."""

    spec: AutoscalingSpec
    min_nodes: int
    max_nodes: int
    window: float = 20.0
    rate_window: float = 6.0  # seconds of the newest samples the production rate is measured over
    drain_seconds: float = 60.0
    samples: list[Sample] = field(default_factory=list)
    last_decision_at: float | None = None
    calm_since: float | None = None
    capacity: float | None = None  # records/s one node did while busy (lag >= half the target)
    decisions: list[Decision] = field(default_factory=list)

    def observe(self, at: float, lag: int, consumed: int, nodes: int) -> Decision | None:
        """Add a sample; return a decision if one is due (the caller applies it)."""
        if self.samples and self.samples[-1].nodes != nodes:
            self.samples.clear()  # throughput per node changed meaning
        self.samples.append(Sample(at, lag, consumed, nodes))
        self.samples = [s for s in self.samples if s.at >= at - self.window] or self.samples[-1:]
        if len(self.samples) < 2 or self.samples[-1].at - self.samples[0].at < min(self.window / 2, 5.0):
            return None
        first, last = self.samples[0], self.samples[-1]
        span = last.at - first.at
        consume = max(0.0, (last.consumed - first.consumed) / span)
        per_node = consume / nodes if nodes else 0.0
        # production over the newest samples only: a window spanning a rate step would under-estimate it
        recent = [s for s in self.samples if s.at >= at - self.rate_window]
        if len(recent) < 2 or recent[-1].at - recent[0].at < self.rate_window / 2:
            recent = self.samples[-2:]
        produce = _production(recent) or 0.0
        target = float(self.spec.target_lag_records or (self.spec.target_freshness_seconds or 0.0) * produce)
        target = max(target, 1.0)
        # far below what a node did while busy (a rendezvous or restore pauses training; its first and last
        # seconds trickle): a node still does what it did while busy
        capacity = self.capacity or 0.0
        rate = per_node if per_node >= capacity / 2 else capacity
        if rate > 0:
            needed = math.ceil((produce + max(0.0, lag - target) / self.drain_seconds) / rate)
        else:
            needed = nodes + 1 if lag > target else nodes  # nothing ever consumed: only a lag says more
        needed = min(max(needed, self.min_nodes), self.max_nodes)
        if lag >= target / 2 and per_node > (self.capacity or 0.0) / 2:  # busy, not paused
            self.capacity = per_node
        cooling = self.last_decision_at is not None and at - self.last_decision_at < self.spec.cooldown_seconds
        calm = lag < target / 2 and nodes > self.min_nodes and self._fits(produce, nodes) < nodes
        self.calm_since = (self.calm_since if self.calm_since is not None else at) if calm else None
        to, why = nodes, ""
        if lag > target and needed > nodes:
            to, why = needed, "lag above target"
        elif calm and self.calm_since is not None and at - self.calm_since >= self.spec.cooldown_seconds:
            # sized on the production over the whole calm period: the newest seconds may hold one burst of a
            # stream the master sees in bursts (its high watermark moves every few seconds under load)
            produce = _production([s for s in self.samples if s.at >= self.calm_since]) or produce
            to, why = min(self._fits(produce, nodes), nodes), "lag under half the target for a cooldown"
        if to == nodes or (cooling and to < nodes):
            return None
        decision = Decision(at, nodes, to, lag, target, produce, consume, per_node, needed, why)
        self.decisions.append(decision)
        self.last_decision_at, self.calm_since = at, None
        self.samples.clear()
        return decision

    def _fits(self, produce: float, nodes: int) -> int:
        """The nodes that keep up with ``produce`` at 90% of a busy node's rate (one fewer while that is unknown)."""
        fits = math.ceil(produce / (self.capacity * 0.9)) if self.capacity else nodes - 1
        return max(fits, self.min_nodes)


def _production(samples: list[Sample]) -> float | None:
    """Records produced per second between the first and the last of ``samples`` (consumed + the lag's change)."""
    if len(samples) < 2 or samples[-1].at <= samples[0].at:
        return None
    first, last = samples[0], samples[-1]
    return max(0.0, (last.consumed - first.consumed + last.lag - first.lag) / (last.at - first.at))
