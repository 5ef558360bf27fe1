"""What a pack is asked to do: its options, length groups and inputs (:class:`PackJob`, handed
to every task of its waves), and the shards it writes (:class:`ShardTask`).

Which utterance goes into which shard is decided by the waves (``waves.py``): the scan wave reads
the inputs' lines, the bucket wave joins them by key and shuffles each bucket, and shards take
consecutive runs of the buckets' permutations. With shuffling on, every shard is a uniform random
sample of its length group however the inputs are sorted, and shards have exactly
``utts_per_file`` utterances (the last one of a group fewer). The plan is a pure function of the
inputs and options: a crashed or distributed pack recomputes the same one.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from ..checks import check_fields
from ..errors import ConfigError, Where, option
from ..formats.fields import AUDIO_EXTENSIONS
from ..formats.keys import escape_key
from ..formats.patterns import FIELD_SET_NAME
from ..formats.peers.kaldi import ArkLocation, parse_location

if TYPE_CHECKING:
    from .speakers import Speakers


class PackSource(Protocol):
    """Where a pack's utterances come from (``sources.py``: feature matrices of a feats.scp, or
    audio of a wav.scp; ``nemo_source.py``, ``hf_source.py``): the table of one line per
    utterance (``tables``, split by ``parse``, checked by ``check``), the files that give
    lengths, the length of a line's utterance, the feature dim, a reader of utterances for
    writing, and the facts the index records. A source whose table holds the texts too (a NeMo
    manifest, a Hugging Face dataset: ``texts_inside``) splits its lines into labels with
    ``parse_label``."""

    kind: str  # "features" or "audio", as the report names the inputs
    unit: str
    files: Sequence[Path]  # what the pack is made from (its identity)
    tables: Sequence[Path]
    texts_inside: bool

    def parse(self, raw: bytes, where: Where, needs_value: bool) -> tuple[str, str]: ...

    def check(self, key: str, value: str, where: Where) -> Any: ...

    def length_files(self) -> tuple[list[Path], bool]: ...

    def measurer(self) -> Any: ...

    def length(self, measurer: Any, key: str, value: str, where: Where) -> int: ...

    def dim(self, utterances: Iterable[Any]) -> int: ...

    def reader(self, dim: int) -> Any: ...

    def facts(self, dim: int) -> tuple[dict[str, Any], list[str]]: ...


_LOG = logging.getLogger("seqshard")

UTTS_PER_FILE = 2000
RESERVED_FIELDS = ("txt", "feats", "audio", "sample_rate", *AUDIO_EXTENSIONS)  # names of what pack writes
OUTSIDE_LOG_LIMIT = 20  # utterances outside every length group named at INFO level


@dataclass(frozen=True, order=True)
class LengthGroup:
    """Utterances of ``low <= length < high`` (in the source's unit: frames, or 10 ms of
    audio); written to the sub-folder named after the user's spec (``10_1000``, ``1_5``)."""

    low: int
    high: int
    label: str = ""  # the spec as given, e.g. "1:5" (seconds of audio)

    @property
    def name(self) -> str:
        return (self.label or self.spec).replace(":", "_")

    @property
    def spec(self) -> str:
        return self.label or f"{self.low}:{self.high}"

    @classmethod
    def parse(cls, spec: str, seconds: bool = False) -> LengthGroup:
        """``LOW:HIGH`` in frames, or with ``seconds`` in seconds (kept as 10 ms frames)."""
        unit = "seconds" if seconds else "frames"
        low, sep, high = str(spec).partition(":")
        try:
            bounds = (float(low), float(high)) if seconds else (int(low), int(high))
            if not all(map(math.isfinite, bounds)):
                raise ValueError("NaN or infinite")
        except ValueError:
            raise ConfigError(
                f"{option('filter_group', spec)}: expected 'LOW:HIGH' in {unit}, e.g. '{'1:5' if seconds else '10:1000'}'."
            ) from None
        group = cls(round(bounds[0] * 100), round(bounds[1] * 100), str(spec)) if seconds else cls(*bounds)  # type: ignore[arg-type]
        if not sep or group.low < 0 or group.high <= group.low:
            raise ConfigError(f"{option('filter_group', spec)}: expected 'LOW:HIGH' with 0 <= LOW < HIGH.")
        return group


def parse_groups(specs: Sequence[str] | str | None, seconds: bool = False) -> tuple[LengthGroup, ...]:
    """Parse and check ``filter_group`` (in seconds for audio); an empty tuple means one
    folder, no length filter."""
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [specs]
    groups = sorted(LengthGroup.parse(s, seconds) for s in specs)
    for before, after in itertools.pairwise(groups):
        if after.low < before.high:
            raise ConfigError(
                f"{option('filter_group', before.spec)} and {option('filter_group', after.spec)} overlap; "
                "an utterance would be packed twice."
            )
    return tuple(groups)


@dataclass(frozen=True)
class PackOptions:
    """Every option that changes what a pack writes (and so its fingerprint)."""

    fmt: str = "data-%05d.tar"
    groups: tuple[LengthGroup, ...] = ()
    utts_per_file: int = UTTS_PER_FILE
    shuffle: bool = True
    seed: int = 0
    dtype: str = "float32"
    skip_bad: bool = False
    escape_keys: bool = False
    allow_pipes: bool = False
    path_map: tuple[tuple[str, str], ...] = ()
    path_root: str | None = None
    num_frames_files: tuple[str, ...] = ()
    audio_format: str = "flac"
    features: str | None = None  # "fbank": features computed from audio at pack time
    num_mel_bins: int = 80
    resample_to: int | None = None
    channel: int | None = None
    fields: tuple[str, ...] = ()  # a manifest's or dataset's other keys kept as fields NAME.json
    utt2spk: str | None = None  # each utterance's speaker, recorded (``speakers.py``)
    cmvn_scp: str | None = None  # the speakers' Kaldi CMVN statistics, recorded

    def __post_init__(self) -> None:
        if self.audio_format not in ("flac", "keep"):
            raise ConfigError(f"{option('audio_format', self.audio_format)}: store audio as 'flac' or 'keep'.")
        if self.features not in (None, "fbank"):
            raise ConfigError(f"{option('features', self.features)}: the features pack computes are 'fbank'.")
        check_fields(self)
        for name in self.fields:
            if not FIELD_SET_NAME.fullmatch(name) or name in RESERVED_FIELDS:
                raise ConfigError(
                    f"{option('fields', name)}: a field name is letters, digits and '_', and not one of "
                    f"{', '.join(RESERVED_FIELDS)} (names of the fields pack writes)."
                )
        if self.dtype not in ("float32", "float16"):
            raise ConfigError(f"{option('dtype', self.dtype)}: the stored type is 'float32' or 'float16'.")
        try:
            first, second = self.fmt % 0, self.fmt % 1
        except (TypeError, ValueError):
            raise ConfigError(
                f"{option('fmt', self.fmt)}: the pattern must hold one integer field, e.g. 'data-%05d.tar'."
            ) from None
        if first == second or not first.endswith(".tar") or "/" in first:
            raise ConfigError(
                f"{option('fmt', self.fmt)}: the pattern must number the shards and end in '.tar', e.g. 'data-%05d.tar'."
            )

    def location(self, value: str, where: Where) -> ArkLocation:
        root = Path(self.path_root) if self.path_root else None
        return parse_location(value, where, self.path_map, root)

    def shard_key(self, key: str) -> str:
        return escape_key(key) if self.escape_keys else key


@dataclass
class ShardTask:
    """One output shard: where it goes and how many planned utterances it holds."""

    ordinal: int  # position among all shards of the pack
    group: str  # sub-folder name, "" without length groups
    index: int  # shard number inside its group
    path: Path
    num_planned: int


@dataclass(frozen=True)
class PackJob:
    """Everything a task of a pack needs, small enough to send to any worker: the output
    folder, options, source, text files (none when the texts are inside the source), length
    files (``seconds``: durations) and the speakers' files; ``buckets``: how many buckets the
    keys are hashed into (from the inputs' size, never from the workers)."""

    d_out: Path
    options: PackOptions
    source: PackSource
    text_files: tuple[Path, ...]
    length_files: tuple[Path, ...]
    seconds: bool
    buckets: int
    lengths_at_scan: bool = False  # the scan reads each utterance's length (length groups, no length files)
    run: str = ""  # the pack's fingerprint (its inputs and options), naming its waves' folder
    utt2spk: Path | None = None
    cmvn_scp: Path | None = None

    def speakers(self) -> Speakers | None:
        """The speakers' statistics the pack adds, when asked for."""
        if self.utt2spk is None and self.cmvn_scp is None:
            return None
        from .speakers import Speakers

        return Speakers(self.utt2spk, self.cmvn_scp, self.options.location, self.options.allow_pipes)

    def table_files(self, table: str) -> Sequence[Path]:
        """The files of one of the pack's tables (see ``chunks.py``)."""
        files = {
            "utts": self.source.tables,
            "labels": self.text_files,
            "lengths": self.length_files,
            "speakers": [self.utt2spk] if self.utt2spk else [],
        }
        return files[table]
