"""The loader's saved state: what identifies a loader, and what differs between two.

A state (``ShardLoader.state_dict()``) holds each rank's position (``merge.RankPosition``)
and the identity of the loader that saved it: its shards, world size and the options that
decide which batches come out. A strict resume needs the same identity; an elastic one
(``strict=False``) only the same shards.
"""

from __future__ import annotations

from typing import Any

from ...errors import StateMismatchError
from ...formats.table import ShardTable
from ...options import LoaderConfig
from .merge import RankPosition

STATE_VERSION = 2  # 2: units hold one byte offset per field file; sample fields


def identity(table: ShardTable, config: LoaderConfig, world_size: int, mix: Any = None) -> dict[str, Any]:
    found = {
        "shards": table.fingerprint(),
        "num_shards": len(table.shards),
        "world_size": world_size,
        "options": config.batch_defining(),
    }
    if mix is not None:  # the sources of a mux and their shares
        found["mix"] = [[name, round(share, 12)] for name, share in zip(mix.names, mix.shares)]
    return found


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, in words."""
    found = []
    for key in ("shards", "num_shards", "world_size", "mix"):
        if saved.get(key) != current.get(key):
            found.append(f"{key} was {saved.get(key)!r}, now {current.get(key)!r}")
    for key, value in current["options"].items():
        if saved.get("options", {}).get(key) != value:
            found.append(f"option {key} was {saved.get('options', {}).get(key)!r}, now {value!r}")
    return found


def check_state(state: dict[str, Any]) -> None:
    version = state.get("seqshard_loader_state")
    if version != STATE_VERSION:
        raise StateMismatchError(
            "not a seqshard loader state of this version"
            + (
                f" (it is version {version}, this seqshard reads {STATE_VERSION}; resume with the seqshard that saved it, or start the epoch afresh)."
                if isinstance(version, int)
                else "."
            )
        )


def saved_positions(state: dict[str, Any]) -> list[RankPosition]:
    """Every saved rank's position, in rank order (elastic resume needs them all)."""
    world_size = state["identity"]["world_size"]
    if sorted(state["ranks"], key=int) != [str(r) for r in range(world_size)]:
        raise StateMismatchError(
            "elastic resume needs the position of every saved rank: save with state_dict(gather=True)."
        )
    return [RankPosition.from_json(state["ranks"][str(r)]) for r in range(world_size)]


def saved_config(state: dict[str, Any], current: LoaderConfig) -> LoaderConfig:
    """The options the state was saved with. Transforms and recipes are saved by name: they
    must be the current ones (their code cannot be rebuilt from a name)."""
    options = dict(state["identity"]["options"])
    now = current.batch_defining()
    for name in ("transforms", "recipe"):
        if options.get(name) != now[name]:
            raise StateMismatchError(
                f"elastic resume needs the {name} the state was saved with ({options.get(name)!r}, now {now[name]!r})."
            )
        options[name] = getattr(current, name)
    if options.get("fields") is not None:
        options["fields"] = tuple(options["fields"])
    return LoaderConfig(**options)
