"""Whether a recipe's actors can ever be placed on the Ray cluster it joined: checked before any
actor starts, so a placement no node can hold fails at once, naming the field, instead of
waiting for the actors' start deadline (Ray holds an infeasible request forever)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from backends.placement import RayPlacement
from pipeline.contracts.errors import RecipeError

# Ray's resource names as the recipe's placement fields ask for them.
_KEYS = {"CPU": "cpus", "GPU": "gpus"}


def demands(
    section: RayPlacement, *, colocated: bool, ranks: int, gpus: Mapping[str, float]
) -> list[tuple[str, dict[str, float]]]:
    """(role, what one actor of it asks Ray for), one entry an actor (`ranks` trainer actors);
    `gpus` by role."""

    def ask(role: str, cpus: float, custom: Mapping[str, float]) -> dict[str, float]:
        wanted = {"CPU": cpus, "GPU": gpus.get(role, 0.0), **custom}
        return {name: amount for name, amount in wanted.items() if amount}

    trainer = ask("trainer", section.trainer_cpus, section.trainer_resources)
    actors = [("trainer", trainer)] * ranks
    if not colocated:
        actors += [("engine", ask("engine", section.engine_cpus, section.engine_resources))] * section.engines
    actors += [("reward", ask("reward", section.reward_cpus, {}))] * section.reward_workers
    environment = ask("environment", section.environment_cpus, {})
    actors += [("environment", environment)] * section.environment_workers
    return actors


def check_fits(actors: Sequence[tuple[str, dict[str, float]]], nodes: Sequence[Mapping[str, Any]]) -> None:
    """`RecipeError` naming the placement field when no alive node could hold one actor, or the
    cluster as a whole could not hold them all. `nodes`: `ray.nodes()`."""
    totals = [node.get("Resources", {}) for node in nodes if node.get("Alive")]
    for role, wanted in actors:
        if any(all(total.get(name, 0.0) >= amount for name, amount in wanted.items()) for total in totals):
            continue
        lacking = [
            (name, amount)
            for name, amount in wanted.items()
            if not any(total.get(name, 0.0) >= amount for total in totals)
        ]
        if not lacking:  # each is somewhere, never all on one node
            fields = ", ".join(_field(role, name) for name in wanted)
            raise RecipeError(
                f"{fields}: a {role} actor asks Ray for {_listed(wanted)} on one node, but no node of the "
                "cluster has all of it; ask for less, or add a node that has it"
            )
        name, amount = lacking[0]
        most = max((total.get(name, 0.0) for total in totals), default=0.0)
        raise RecipeError(
            f"{_field(role, name)}: a {role} actor asks Ray for {amount:g} {name}, but no node of the "
            f"cluster has that many (the most a node has: {most:g}); ask for less, or add a node that has it"
        )
    for name in sorted({name for _, wanted in actors for name in wanted}):
        asked = sum(wanted.get(name, 0.0) for _, wanted in actors)
        has = sum(total.get(name, 0.0) for total in totals)
        if asked > has:
            roles = sorted({role for role, wanted in actors if name in wanted})
            fields = ", ".join(_field(role, name) for role in roles)
            raise RecipeError(
                f"{fields}: the run's actors ask Ray for {asked:g} {name} in all, but the cluster has "
                f"{has:g}; ask for less, or add nodes"
            )


def _field(role: str, resource: str) -> str:
    key = _KEYS.get(resource)
    if key is None:
        return "placement.reward_cpus" if role == "reward" else f"placement.{role}_resources"
    return f"placement.{role}_{key}"


def _listed(wanted: Mapping[str, float]) -> str:
    return ", ".join(f"{amount:g} {name}" for name, amount in wanted.items())
