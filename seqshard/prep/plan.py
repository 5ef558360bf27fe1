"""Planning a pack: which utterance goes into which shard, decided before any feature is read.

The plan joins the scp entries with their labels, drops (or refuses) bad entries, sorts
utterances into length groups and gives each kept utterance a shard. With shuffling on, the
shard of an utterance comes from a seeded permutation of its group, so every shard is a
uniform random sample of the group however the scp is sorted, and shards have exactly
``utts_per_file`` utterances (the last one of a group fewer). The plan is a pure function of
the inputs and options: a crashed or distributed pack recomputes the same one.
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ..errors import ConfigError, InputError, SkipCounter, Where, counted, option
from ..formats.fields import AUDIO_EXTENSIONS
from ..formats.keys import escape_key
from ..formats.patterns import FIELD_SET_NAME
from ..formats.peers.kaldi import ArkLocation, parse_location
from ..formats.peers.keytable import KeyTable
from ..seeds import pack_order_rng

if TYPE_CHECKING:
    from .speakers import Speakers


class PackSource(Protocol):
    """Where a pack's utterances come from (``sources.py``: feature matrices of a feats.scp, or
    audio of a wav.scp; ``nemo_source.py``, ``hf_source.py``): its table files, the scan of
    their lines, each row's length, the feature dim, a reader of rows for writing, and the
    facts the index records. A source whose inputs hold the texts too (a NeMo manifest, a
    Hugging Face dataset) also has ``scan_labels(issues, check) -> KeyTable``, read instead
    of text files."""

    kind: str  # "features" or "audio", as the report names the inputs
    files: Sequence[Path]

    def scan(self, drops: SkipCounter, progress: Callable[[int], None] | None) -> KeyTable: ...

    def lengths(
        self, table: KeyTable, keep: np.ndarray, drops: SkipCounter, issues: SkipCounter, progress: Any
    ) -> np.ndarray: ...

    def dim(self, plan: PackPlan) -> int: ...

    def reader(self, plan: PackPlan, dim: int) -> Any: ...

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
        if self.utts_per_file < 1:
            raise ConfigError(f"{option('utts_per_file', self.utts_per_file)}: a shard holds at least 1 utterance.")
        if self.resample_to is not None and self.resample_to < 1:
            raise ConfigError(f"{option('resample_to', self.resample_to)}: a sample rate is at least 1 Hz.")
        if self.channel is not None and self.channel < 0:
            raise ConfigError(f"{option('channel', self.channel)}: channels are numbered from 0.")
        if self.num_mel_bins < 3:
            raise ConfigError(
                f"{option('num_mel_bins', self.num_mel_bins)}: fbank takes at least 3 mel bins (as Kaldi)."
            )
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


@dataclass
class PackPlan:
    """Per utterance row (of ``scp``: the feats.scp, wav.scp or segments lines): its label
    row, length (-1 unknown) and shard ordinal (-1 dropped); ``source`` reads the rows."""

    source: PackSource
    scp: KeyTable
    labels: KeyTable
    label_rows: np.ndarray
    frames: np.ndarray
    shard_of_row: np.ndarray
    tasks: list[ShardTask]
    group_names: list[str]
    input_lines: int
    dropped: dict[str, int] = field(default_factory=dict)  # utterance drops by reason
    label_issues: dict[str, int] = field(default_factory=dict)  # text-side problems by reason
    num_labels: int = 0
    frames_file_issues: dict[str, int] = field(default_factory=dict)  # length-file lines skipped, by reason
    speakers: Speakers | None = None  # speaker and CMVN members of each utterance (pack --utt2spk/--cmvn-scp)

    @property
    def num_planned(self) -> int:
        return int((self.shard_of_row >= 0).sum())

    def planned_utterances(self) -> Iterator[tuple[str, Where]]:
        """Each planned utterance's key and where its scp line is, in scp order."""
        for row in np.flatnonzero(self.shard_of_row >= 0):
            key = self.scp.record(int(row))[0]
            yield key, self.scp.where(int(row), key)


def build_plan(
    source: PackSource,
    text_files: Sequence[Path],
    d_out: Path,
    options: PackOptions,
    progress: Callable[..., Callable[[int], None]] | None = None,
) -> PackPlan:
    """Scan the inputs and decide every utterance's fate (see the module docstring)."""
    drops = SkipCounter(options.skip_bad)
    label_issues = SkipCounter(options.skip_bad)
    scan_progress = (
        progress("scan inputs", sum(Path(f).stat().st_size for f in [*source.files, *text_files]), "B")
        if progress
        else None
    )
    scp = source.scan(drops, scan_progress)
    empty_labels: list[Where] = []

    def note_empty(key: str, value: str, where: Where) -> None:
        if not value:
            empty_labels.append(where)

    scan_labels = getattr(source, "scan_labels", None)
    if scan_labels is not None:
        labels = scan_labels(label_issues, note_empty)
    else:
        labels = KeyTable.scan(text_files, label_issues, needs_value=False, check=note_empty, progress=scan_progress)
    if empty_labels:  # kept (a silent recording may have none), but never unannounced
        _LOG.warning(
            "%s empty, packed as empty texts (first: %s)", counted(len(empty_labels), "label", "is"), empty_labels[0]
        )
        label_issues.counts["empty_label"] = len(empty_labels)
    if len(scp) + scp.bad_lines == 0:
        raise InputError(
            Where(", ".join(map(str, source.files))),
            "empty_input",
            "the input files hold no entries.",
            "check that you gave the right feats.scp, wav.scp or segments.",
            skippable=False,
        )
    keep = np.ones(len(scp), dtype=bool)

    keep &= ~scp.report_repeats(
        drops,
        "duplicate_key",
        "the key was already given at {first} (skipping keeps that first entry).",
        "remove duplicate entries (utils/fix_data_dir.sh).",
    )
    duplicate_labels = labels.report_repeats(
        label_issues,
        "duplicate_label",
        "the key already has a label at {first} (skipping keeps that first label).",
        "remove duplicate lines from the text files.",
    )

    label_rows = labels.lookup(scp.hashes).astype(np.int32 if len(labels) < 2**31 else np.int64, copy=False)
    for row in np.flatnonzero(keep & (label_rows < 0)):
        key = scp.record(int(row))[0]
        drops(
            InputError(
                scp.where(int(row), key),
                "no_label",
                f"the utterance has {source.kind} but no label in the text files.",
                "add its label.",
            )
        )
        keep[row] = False

    used = np.zeros(len(labels), dtype=bool)
    used[label_rows[keep]] = True
    dropped_lines = labels.lookup(scp.bad_key_hashes)  # already one drop each, under the line's reason
    used[dropped_lines[dropped_lines >= 0]] = True
    unused = np.flatnonzero(~used & ~duplicate_labels)
    for number, row in enumerate(unused):
        key = labels.record(int(row))[0]
        label_issues(
            InputError(
                labels.where(int(row), key),
                "no_features",
                f"the label has no {source.kind} in the input files{_and_more(len(unused)) if number == 0 else ''}.",
                f"add its {source.kind}.",
            )
        )

    frames = np.full(len(scp), -1, dtype=np.int32)
    group_of_row = np.zeros(len(scp), dtype=np.int16)
    outside = 0
    frames_file_issues = SkipCounter(options.skip_bad, done="line ignored, length read from the input")
    if options.groups:
        frames = source.lengths(scp, keep, drops, frames_file_issues, progress)
        keep &= frames >= 0
        zero = keep & (frames == 0)
        for row in np.flatnonzero(zero):
            drops(
                InputError(
                    scp.where(int(row), scp.record(int(row))[0]),
                    "zero_length",
                    "the utterance has no length (0 frames).",
                    "remove it.",
                )
            )
        keep &= ~zero
        group_of_row = np.full(len(scp), -1, dtype=np.int16)
        for number, group in enumerate(options.groups):
            group_of_row[(frames >= group.low) & (frames < group.high)] = number
        outside_rows = np.flatnonzero(keep & (group_of_row < 0))
        outside = len(outside_rows)
        _log_outside(scp, frames, outside_rows, options.groups)
        keep &= group_of_row >= 0

    shard_of_row = np.full(len(scp), -1, dtype=np.int32)
    tasks: list[ShardTask] = []
    group_names = [g.name for g in options.groups] or [""]
    for number, name in enumerate(group_names):
        rows = np.flatnonzero(keep & (group_of_row == number))
        positions = np.arange(len(rows))
        if options.shuffle:
            group = options.groups[number] if options.groups else None
            bounds = (group.low, group.high) if group else ()
            positions = pack_order_rng(options.seed, *bounds).permutation(len(rows))
        positions //= options.utts_per_file  # in place: each row's shard in its group (memory, not time)
        num_shards = math.ceil(len(rows) / options.utts_per_file)
        counts = np.bincount(positions, minlength=num_shards)
        folder = d_out / name if name else d_out
        first_ordinal = len(tasks)
        for index in range(num_shards):
            tasks.append(
                ShardTask(first_ordinal + index, name, index, folder / (options.fmt % index), int(counts[index]))
            )
        positions += first_ordinal
        shard_of_row[rows] = positions
        del rows, positions

    dropped = dict(drops.counts)
    if outside:
        dropped["outside_groups"] = outside
    scp.forget_lookups()  # writing re-reads rows by number only
    labels.forget_lookups()
    return PackPlan(
        source,
        scp,
        labels,
        label_rows,
        frames,
        shard_of_row,
        tasks,
        group_names,
        len(scp) + scp.bad_lines,
        dropped,
        dict(label_issues.counts),
        len(labels) + labels.bad_lines,
        dict(frames_file_issues.counts),
    )


def _log_outside(scp: KeyTable, frames: np.ndarray, rows: np.ndarray, groups: Sequence[LengthGroup]) -> None:
    """Name, at INFO level, the first utterances dropped as outside every length group."""
    if not len(rows) or not _LOG.isEnabledFor(logging.INFO):
        return
    specs = ", ".join(f"[{g.low}, {g.high})" for g in groups)
    for row in rows[:OUTSIDE_LOG_LIMIT]:
        key = scp.record(int(row))[0]
        _LOG.info(
            "dropped (outside_groups): %s: %d frames, outside every length group (%s)",
            scp.where(int(row), key),
            int(frames[row]),
            specs,
        )
    if len(rows) > OUTSIDE_LOG_LIMIT:
        _LOG.info(
            "dropped (outside_groups): %d more utterances outside every length group", len(rows) - OUTSIDE_LOG_LIMIT
        )


def _and_more(count: int) -> str:
    return f" ({count - 1} more labels have the same problem)" if count > 1 else ""
