"""Which field files a loader opens and which fields it decodes (``make_loader(fields=...)``).

A field is found in the shard's own members (field set ``MAIN``) or in a sidecar field set
added with ``seqshard add-field``. Only the field sets holding a requested field are opened:
asking for labels alone never reads the feature shards. A Lhotse Shar folder is read whole by
default, as lhotse reads it (every field file; ``features`` is its feature field).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import ConfigError
from ...formats.fields import AUDIO_EXTENSIONS, field_name, split_suffix
from ...formats.peers.shar import FEATURES
from ...formats.table import MAIN, ShardTable
from .decode import LABEL_FIELD, LEGACY_FEATURE_FIELDS

BATCHED_AS = {"npy": "padded", "txt": "list", "json": "list"}  # member extension -> how batches hold it


@dataclass(frozen=True)
class FieldPlan:
    """``sets``: the field sets to open, in order; ``wanted``: the field names to decode
    (None: every field of the opened sets); ``features``: the feature field (batched as
    ``feats``/``feat_lens`` and measured in frames), or None when not read; ``audio``: the
    encoded-audio field read (``wav``, ``flac``, ...), if any; ``batched``: each wanted array
    (``.npy``) or text (``.txt``, ``.json``) field with how it is batched (``"padded"`` or
    ``"list"``) and, for an array field added with ``add-field``, its dtype and shape after
    the first axis, so that a batch where no sample has it still carries it, shaped as the
    others."""

    sets: tuple[str, ...]
    wanted: frozenset[str] | None
    features: str | None
    audio: str | None = None
    batched: tuple[tuple[str, str, tuple[str, tuple[int, ...]] | None], ...] = ()


def plan_fields(
    table: ShardTable, fields: Sequence[str] | None, feature_field: str | None, needs_text: bool
) -> FieldPlan:
    """The field plan for ``fields`` (None: the shards' own fields); ``needs_text`` adds the
    label field (a tokenizer needs it unless labels come from a file)."""
    rows = [
        (set_name, suffix, *split_suffix(suffix)[:2]) for set_name, suffixes in table.field_sets for suffix in suffixes
    ]
    available = {set_name: tuple(map(field_name, suffixes)) for set_name, suffixes in table.field_sets}
    main = available.get(MAIN, ())
    shar = table.shar
    default_features = FEATURES if shar else next((f for f in LEGACY_FEATURE_FIELDS if f in main), None)
    features = field_name(feature_field) if feature_field else default_features
    everywhere = [name for names in available.values() for name in names]
    if fields is None and shar:
        fields = everywhere
    if feature_field and main and features not in everywhere:
        raise ConfigError(
            f"feature_field {feature_field!r}: the shards have no such field (they have: {', '.join(everywhere)})."
        )
    if fields is not None:  # names or member suffixes, as `seqshard inspect` lists them
        suffixes = {suffix for _, suffix, _, _ in rows}
        fields = [field_name(f) if f in suffixes else f for f in fields]
    audio = next(  # the first field of encoded audio among the main fields (or the wanted ones)
        (n for s, _, n, e in rows if e in AUDIO_EXTENSIONS and (n in fields if fields is not None else s == MAIN)), None
    )
    if fields is None:
        return FieldPlan((MAIN,), None, features if features in main or not main else None, audio)
    wanted = dict.fromkeys(fields)
    if needs_text:
        wanted.setdefault(LABEL_FIELD, None)
    sets: dict[str, None] = {}
    for name in wanted:
        owner = next((s for s, names in available.items() if name in names), None)
        if owner is None:
            known = ", ".join(f"{n} ({'shard' if s == MAIN else s})" for s, names in available.items() for n in names)
            raise ConfigError(f"fields: no field set holds {name!r}; the shards have: {known or 'no index to tell'}.")
        sets[owner] = None
    for set_name in sets:
        if set_name != MAIN:
            lacking = table.shards.lacking(set_name)
            if lacking is not None:
                raise ConfigError(
                    f"fields: {lacking} has no field set {set_name!r} (add it with `seqshard add-field` to every folder read)."
                )
    ordered = tuple(s for s in (MAIN, *sorted(sets.keys() - {MAIN})) if s in sets)  # each set opened once
    layouts = {name: (dtype, shape) for name, dtype, shape in table.layouts}
    batched = tuple((n, BATCHED_AS[e], layouts.get(n)) for _, _, n, e in rows if n in wanted and e in BATCHED_AS)
    return FieldPlan(ordered, frozenset(wanted), features if features in wanted else None, audio, batched)
