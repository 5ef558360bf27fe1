"""Turning raw samples into utterances: features as arrays viewing the bytes read (no copy)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import InputError, Where
from ..formats.keys import unescape_key
from .reader import RawSample
from .shards import ShardTable

FEATURE_FIELDS = ("feats.npy", "npy")
LABEL_FIELD = "txt"


@dataclass
class Utterance:
    """One training example on its way to a batch."""

    key: str
    feats: np.ndarray
    text: str
    shard: int = -1
    offset: int = -1
    ordinal: int = -1
    tokens: list[int] | None = None

    @property
    def num_frames(self) -> int:
        return int(self.feats.shape[0])

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) if self.tokens is not None else 0


class Decoder:
    """RawSample -> Utterance. The feature field is ``feature_field``, else the first of
    ``feats.npy``/``npy`` present; a sample without features or with an unreadable label
    raises InputError naming shard, byte offset and key. Keys percent-encoded at pack time
    (``--escape-keys``) come out as they were in the scp."""

    def __init__(self, table: ShardTable, feature_field: str | None = None):
        self.table = table
        self.feature_field = feature_field

    def _where(self, raw: RawSample) -> Where:
        return Where(f"{self.table.shards[raw.shard].path}@{raw.offset}", None, raw.key)

    def __call__(self, raw: RawSample) -> Utterance:
        names = (self.feature_field,) if self.feature_field else FEATURE_FIELDS
        data = next((raw.fields[n] for n in names if n in raw.fields), None)
        if data is None:
            raise InputError(
                self._where(raw),
                "no_features",
                f"the sample has no {' or '.join(names)} field (it has: {', '.join(sorted(raw.fields)) or 'nothing'}).",
                "pass feature_field= to name the field holding a T x D .npy array.",
            )
        try:
            feats = _decode_features(data)
        except ValueError as error:
            raise InputError(self._where(raw), "bad_features", f"the features cannot be read: {error}.") from None
        text = ""
        if LABEL_FIELD in raw.fields:
            try:
                text = str(raw.fields[LABEL_FIELD], "utf-8").strip()
            except UnicodeDecodeError:
                raise InputError(self._where(raw), "non_utf8", "the label is not valid UTF-8.") from None
        key = unescape_key(raw.key) if self.table.shards[raw.shard].escaped_keys else raw.key
        return Utterance(key, feats, text, raw.shard, raw.offset, raw.ordinal)


def _decode_features(data: bytes) -> np.ndarray:
    from ..formats.npy import decode_npy

    feats = decode_npy(data)
    if feats.ndim != 2 or feats.dtype.kind != "f":
        raise ValueError(f"expected a 2-D float array, found {feats.dtype} {feats.shape}")
    return feats
