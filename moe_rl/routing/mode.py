"""The routing mode of a run (`--routing-mode native|R2|R3` with `--replay.*`), as one object the trainer asks.

| mode     | the sampler records | the old pass            | each update replays                     |
|----------|---------------------|-------------------------|-----------------------------------------|
| `native` | nothing             | records its own routing | nothing: every router chooses           |
| `R2`     | nothing             | records its own routing | the old pass's routing (theta_old's)    |
| `R3`     | its routing         | replays the sampler's   | the sampler's routing (the rollout's)   |

The replay variants (`ReplayConfig`: the sampler's gate weights, a margin threshold) apply wherever a trace is
replayed. docs/design.md section 4 gives the routing contract they act through.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from moe_rl.errors import ConfigError, check_choice
from moe_rl.routing.replay import ReplayConfig
from moe_rl.routing.trace import RoutingTrace

ModeName = Literal["native", "R2", "R3"]
MODE_NAMES: tuple[str, ...] = get_args(ModeName)


@dataclass(frozen=True)
class RoutingMode:
    """What a routing mode records and replays; `RoutingMode.of` checks the name and the variants together."""

    name: ModeName
    replay: ReplayConfig

    @classmethod
    def of(cls, name: str, replay: ReplayConfig | None = None) -> RoutingMode:
        check_choice("routing_mode", name, MODE_NAMES)
        replay = replay or ReplayConfig()
        if replay.gate_weights and name != "R3":
            raise ConfigError(f"replay.gate_weights replays the sampler's gate weights: it needs routing_mode R3, "
                              f"not {name!r}")
        if replay.margin_threshold is not None and name == "native":
            raise ConfigError("replay.margin_threshold needs routing_mode R2 or R3 (native routing replays nothing)")
        return cls(name, replay)

    @property
    def replays_sampler(self) -> bool:
        """R3: the sampler's routing is replayed by the old pass and every update."""
        return self.name == "R3"

    @property
    def replays_old_pass(self) -> bool:
        """R2: every update replays the routing the old pass chose."""
        return self.name == "R2"

    @property
    def sampler_records_weights(self) -> bool:
        """The sampler keeps its gate weights with its ids (R3 gate-weight replay)."""
        return self.replay.gate_weights

    def old_pass_replay(self, sampler_routing: RoutingTrace | None) -> RoutingTrace | None:
        """The trace the old pass replays (the sampler's under R3); None: the old pass routes natively and records."""
        return sampler_routing if self.replays_sampler else None

    def update_replay(self, sampler_routing: RoutingTrace | None, old_routing: RoutingTrace) -> RoutingTrace | None:
        """The trace an update's forward replays, for the same rows; None: the routers choose."""
        if self.replays_sampler:
            return sampler_routing
        if self.replays_old_pass:
            return old_routing
        return None
