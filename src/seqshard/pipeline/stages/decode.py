"""Decoding a sample's members into named fields (see ``formats/fields.py`` for the decoders).

Arrays are views of the bytes read (no copy). Only the fields a loader asks for are decoded;
the ones it needs (the feature field, when it batches by frames) must be there.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection
from typing import Any

from ...errors import InputError, Where
from ...formats.fields import ABSENT, DECODERS, InflationError, decode_field, field_name, split_suffix
from ...formats.keys import unescape_key
from ...formats.peers.lists import READ_ERROR_FIELD
from ...formats.table import ShardTable
from .sample import Sample

LABEL_FIELD = "txt"
LEGACY_FEATURE_FIELDS = ("feats", "npy")  # `feats.npy` as packed; `npy` in shards of other tools


class Decoder:
    """Sample (members by suffix) -> Sample (fields by name, decoded by extension).

    ``wanted``: the field names to decode (None: all). ``features``: the feature field, which
    must be a T x D float array; a sample without it, or with a member that does not decode,
    raises InputError naming shard, byte offset and key. Keys percent-encoded at pack time
    (``--escape-keys``) come out as they were in the scp.
    """

    def __init__(self, table: ShardTable, wanted: Collection[str] | None = None, features: str | None = None):
        self.table = table
        self.wanted = None if wanted is None else frozenset(wanted)
        self.features = features
        self._plans: dict[str, tuple[str, Callable[[Any], Any] | None]] = {}  # by member suffix

    def _where(self, sample: Sample) -> Where:
        shard = self.table.shards[sample.shard]
        name, offset = sample.offsets[0] if sample.offsets else ("", -1)
        return Where(f"{shard.file_of(name)}@{offset}", None, sample.key)

    def __call__(self, sample: Sample) -> Sample:
        problem = sample.fields.get(READ_ERROR_FIELD)
        if problem is not None:  # a list line or audio file the read stage could not read
            reason, text, fix = str(problem, "utf-8").split("\t", 2)
            raise InputError(sample.where(), reason, text, fix or None)
        fields = {}
        plans = self._plans
        for suffix, data in sample.fields.items():
            plan = plans.get(suffix)
            if plan is None:
                plan = plans[suffix] = self._plan(suffix)
            name, decode = plan
            if decode is None:  # a field not asked for
                continue
            if name in fields:
                raise InputError(self._where(sample), "bad_field", f"two members hold field {name!r}.")
            try:
                value = decode(data)
            except Exception:  # decode_field says how (its messages), or it was a fast decoder's slip
                value = self._decoded(sample, suffix, name, data)
            if value is not ABSENT:
                fields[name] = value  # text as stored (the label stage strips what it tokenizes)
        if self.features is not None:
            self._check_features(sample, fields)
        if self.table.shards[sample.shard].escaped_keys:
            sample.key = unescape_key(sample.key)
        sample.fields = fields
        return sample

    def _plan(self, suffix: str) -> tuple[str, Callable[[Any], Any] | None]:
        """A member suffix's field name and how it is decoded (None: not asked for): its
        extension's decoder itself where ``decode_field`` would only call it."""
        name = field_name(suffix)
        if self.wanted is not None and name not in self.wanted:
            return name, None
        _, extension, gzipped = split_suffix(suffix)
        decoder = DECODERS.get(extension)
        return name, decoder if decoder is not None and not gzipped else functools.partial(decode_field, suffix)

    def _decoded(self, sample: Sample, suffix: str, name: str, data: bytes | memoryview) -> Any:
        """``decode_field``'s value, or the InputError its error makes."""
        try:
            return decode_field(suffix, data)
        except InflationError as error:
            raise InputError(
                self._where(sample),
                "decompression_limit",
                f"member .{suffix} is not decoded: {error}.",
                f"if such members are real, read only the fields you need (fields= without {name!r}).",
            ) from None
        except ValueError as error:
            raise InputError(
                self._where(sample), self._reason(name, suffix), f"member .{suffix} cannot be read: {error}."
            ) from None

    def _reason(self, name: str, suffix: str) -> str:
        if name == self.features:
            return "bad_features"
        return "non_utf8" if split_suffix(suffix)[1] in ("txt", "text") else "bad_field"

    def _check_features(self, sample: Sample, fields: dict) -> None:
        feats = fields.get(self.features)
        if feats is None:
            raise InputError(
                self._where(sample),
                "no_features",
                f"the sample has no {self.features!r} field (it has: {', '.join(sorted(sample.fields)) or 'nothing'}).",
                "pass feature_field= to name the field holding a T x D .npy array.",
            )
        if getattr(feats, "ndim", 0) != 2 or feats.dtype.kind != "f":
            raise InputError(
                self._where(sample),
                "bad_features",
                f"the features cannot be read: expected a 2-D float array, found {getattr(feats, 'dtype', type(feats).__name__)} {getattr(feats, 'shape', '')}.",
            )
