"""The loader's saved state: what identifies a loader, and what differs between two.

A state (``ShardLoader.state_dict()``) holds each rank's position (``merge.RankPosition``)
and the identity of the loader that saved it: its shards, world size and the options that
decide which batches come out. A strict resume needs the same identity; an elastic one
(``strict=False``) only the same shards.
"""

from __future__ import annotations

import json
from typing import Any

from ...dist import Collectives
from ...errors import ConfigError, StateMismatchError
from ...formats.remote.access import RemoteAccess
from ...formats.table import ShardTable
from ...options import LoaderOptions
from ..workers.setup import WorkerSetup
from .elastic import elastic_position
from .merge import RankPosition

STATE_VERSION = 5  # 2: units hold one byte offset per field file; sample fields; 3: windows grow;
# 4: the ranks agree on an epoch's end now and then (epochs.py), bucket sync is the readers' (stages/buckets.py);
# 5: a window's state holds its outputs by their samples' origins (stages/held.py)
# a version 2 state goes on with full windows until its epoch ends; one before 5 restores its
# windows by reading them again (it holds no origins)
READABLE_VERSIONS = (2, 3, 4, 5)
MIXING = "source stage"  # how a mix is composed: since its sources became one stage under the windows


def identity(table: ShardTable, options: LoaderOptions, world_size: int, mix: Any = None) -> dict[str, Any]:
    found = {
        "shards": table.fingerprint(),
        "num_shards": len(table.shards),
        "world_size": world_size,
        "options": options.batch_defining(),
    }
    if mix is not None:  # the sources of a mux and their shares
        found["mix"] = [[name, round(share, 12)] for name, share in zip(mix.names, mix.shares)]
        found["mixing"] = MIXING
    return found


def state(position: RankPosition, identity: dict[str, Any], collectives: Collectives, gather: bool) -> dict[str, Any]:
    """A loader's state: this rank's position (every rank's with ``gather``, a collective) and
    the identity of the loader."""
    local = position.to_json()
    ranks = collectives.all_gather(local) if gather else [local]
    rank = collectives.context.rank
    return {
        "seqshard_loader_state": STATE_VERSION,
        "identity": identity,
        "epoch": position.epoch,
        "ranks": {str(r): s for r, s in enumerate(ranks)} if gather else {str(rank): local},
    }


def restore(
    state: dict[str, Any],
    identity: dict[str, Any],
    setup: WorkerSetup,
    access: RemoteAccess,
    collectives: Collectives,
    strict: bool,
) -> RankPosition:
    """Where this rank goes on from ``state``, saved by a loader of ``identity``'s shards: its
    own saved position, or (``strict=False``, other ranks, workers or options) an elastic one."""
    check_state(state)
    if state["seqshard_loader_state"] < 4 and state["identity"].get("options", {}).get("bucket_sync"):
        raise StateMismatchError(
            "the state was saved with bucket_sync by a seqshard that held batches back in the training process "
            f"(state version {state['seqshard_loader_state']}); this one orders each reader's batches by bucket: "
            "its positions do not fit. Start the epoch afresh."
        )
    if "mix" in state["identity"] and state["identity"].get("mixing") != MIXING:
        raise StateMismatchError(
            "the state was saved by a seqshard that composed mixes otherwise (a shuffle window per source): "
            "its positions do not fit this one's pipeline; start the epoch afresh."
        )
    found = differences(state["identity"], identity)
    if found and (strict or state["identity"]["shards"] != identity["shards"]):
        raise StateMismatchError(
            "the saved loader state does not fit this loader: "
            + "; ".join(found)
            + ". Resume with the same shards and settings, pass strict=False to resume the epoch elastically "
            "(same shards, other ranks/workers/options), or start the epoch afresh."
        )
    if found:
        return elastic_position(state, setup, access, collectives)
    mine = state["ranks"].get(str(setup.rank))
    if mine is None:
        raise StateMismatchError(
            f"the saved state has no position for rank {setup.rank} (saved with gather=False on another rank?)."
        )
    position = RankPosition.from_json(mine)
    if state["seqshard_loader_state"] == 2:  # its windows did not grow: the rest of its epoch neither
        position.windows_grow = False
    return position


def check_ranks_agree(identity: dict[str, Any], collectives: Collectives) -> bool:
    """Every rank must read the same shards with the same options (a rank given other shards
    would otherwise go unnoticed): checked once, where the ranks talk anyway; True, or
    ConfigError naming the ranks and what differs."""
    identities = collectives.all_gather(json.dumps(identity, sort_keys=True))
    differing = [rank for rank, found in enumerate(identities) if found != identities[0]]
    if differing:
        found = differences(json.loads(identities[differing[0]]), json.loads(identities[0]))
        raise ConfigError(
            f"rank(s) {differing} made their loader with other shards or options than rank 0 "
            f"({'; '.join(found)}). Give every rank the same patterns and options."
        )
    return True


def differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """What differs between two identities, in words."""
    found = []
    for key in ("shards", "num_shards", "world_size", "mix"):
        if saved.get(key) != current.get(key):
            found.append(f"{key} was {saved.get(key)!r}, now {current.get(key)!r}")
    before = saved.get("options", {})
    for key, value in current["options"].items():
        if key not in before and value == LoaderOptions.default_of(key):
            continue  # an option added since the state was saved, at the default its loader behaved as
        if before.get(key) != value:
            found.append(f"option {key} was {before.get(key)!r}, now {value!r}")
    return found


def check_state(state: dict[str, Any]) -> None:
    version = state.get("seqshard_loader_state")
    if version not in READABLE_VERSIONS:
        readable = " and ".join(map(str, READABLE_VERSIONS))
        raise StateMismatchError(
            "not a seqshard loader state of this version"
            + (
                f" (it is version {version}, this seqshard reads {readable}; resume with the seqshard that saved it, or start the epoch afresh)."
                if isinstance(version, int)
                else "."
            )
        )
