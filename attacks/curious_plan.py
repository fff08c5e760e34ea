"""Which updates the curious server attacks (``[attack] rounds / every / victims / seed``): the planning
half of :class:`attacks.curious.CuriousServer`, checked against the federation when it is built."""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from fedsim.observers import ClientUpdate
from fedsim.seeding import derive_seed


class AttackPlan:
    """The attacked rounds (a list, ``"all"``, or every k-th) and victims (``"sampled"``: every client of
    the round; ``k``: k random ones, seeded; a list of client ids)."""

    def __init__(self, fed: Mapping[str, Any], rounds: str | list[int] | None, every: int,
                 victims: str | int | list[int], seed: int):
        rounds = [1] if rounds is None else rounds
        if not (rounds == "all" or (isinstance(rounds, list) and all(isinstance(r, int) and r >= 1 for r in rounds))):
            raise ValueError(f"attack.rounds must be \"all\" or a list of round numbers >= 1, got {rounds!r}")
        if every < 0:
            raise ValueError(f"attack.every must be an integer >= 0, got {every!r}")
        n_rounds = fed["rounds"]
        if isinstance(rounds, list) and any(r > n_rounds for r in rounds):
            raise ValueError(f"attack.rounds {sorted(r for r in rounds if r > n_rounds)} are after the last round "
                             f"(federation.rounds = {n_rounds}): nothing would be attacked there")
        n_clients = fed["num_clients"]
        if isinstance(victims, int) and not isinstance(victims, bool) and victims > n_clients:
            raise ValueError(f"attack.victims = {victims} asks for more victims than the federation has clients "
                             f"(federation.num_clients = {n_clients})")
        ok = victims == "sampled" or (isinstance(victims, int) and not isinstance(victims, bool) and victims >= 1) \
            or (isinstance(victims, list) and all(isinstance(v, int) and 0 <= v < n_clients for v in victims))
        if not ok:
            raise ValueError(f"attack.victims must be \"sampled\", a positive integer k, or a list of client ids in "
                             f"0..{n_clients - 1}, got {victims!r}")
        self.rounds, self.every, self.victims, self.seed = rounds, int(every), victims, int(seed)

    def attacks_round(self, rnd: int) -> bool:
        if self.every:
            return (rnd - 1) % self.every == 0
        return self.rounds == "all" or rnd in self.rounds

    def chosen_victims(self, rnd: int, sampled: list[int]) -> list[int]:
        """The victims among the clients whose update of round ``rnd`` the server could read."""
        if self.victims == "sampled":
            return sorted(sampled)
        if isinstance(self.victims, int):
            rng = np.random.default_rng(derive_seed(self.seed, rnd, 0xC0))
            return sorted(rng.choice(sorted(sampled), size=min(self.victims, len(sampled)), replace=False).tolist())
        return sorted(v for v in self.victims if v in sampled)

    def attacks_aggregate(self, update: ClientUpdate) -> bool:
        """An aggregate is attacked when every contributor may be a victim, or a chosen victim is one."""
        if self.victims == "sampled" or isinstance(self.victims, int):
            return True
        return any(v in update.contributors for v in self.victims)

    def missing(self, rnd: int, got: list[int]) -> str | None:
        """The warning for victims asked for but not readable in round ``rnd`` (None when all were)."""
        if isinstance(self.victims, list):
            missed = [v for v in self.victims if v not in got]
            if missed:
                return f"round {rnd}: victims {missed} sent no readable update (not sampled, or failed); not attacked"
        elif isinstance(self.victims, int) and not isinstance(self.victims, bool) and len(got) < self.victims:
            return f"round {rnd}: {self.victims} victims asked for, {len(got)} readable updates; attacked those"
        return None

    def describe(self) -> str:
        """How the report names the plan: ``rounds [1], victims [0, 1]``."""
        return f"rounds {self.rounds if not self.every else f'every {self.every}'}, victims {self.victims}"
