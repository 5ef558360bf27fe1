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
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ConfigError, InputError, SkipCounter, Where, option
from ..formats.kaldi import ArkLocation, MatrixReader, parse_location
from ..formats.keys import escape_key, key_problem
from .tables import KeyTable

_LOG = logging.getLogger("seqshard")

UTTS_PER_FILE = 2000
NUM_FRAMES_FILE = "utt2num_frames"
OUTSIDE_LOG_LIMIT = 20  # utterances outside every length group named at INFO level


@dataclass(frozen=True, order=True)
class LengthGroup:
    """Utterances of ``low <= frames < high``; written to the sub-folder ``low_high``."""

    low: int
    high: int

    @property
    def name(self) -> str:
        return f"{self.low}_{self.high}"

    @property
    def spec(self) -> str:
        return f"{self.low}:{self.high}"

    @classmethod
    def parse(cls, spec: str) -> LengthGroup:
        low, sep, high = str(spec).partition(":")
        try:
            group = cls(int(low), int(high))
        except ValueError:
            raise ConfigError(
                f"{option('filter_group', spec)}: expected 'LOW:HIGH' in frames, e.g. '10:1000'."
            ) from None
        if not sep or group.low < 0 or group.high <= group.low:
            raise ConfigError(f"{option('filter_group', spec)}: expected 'LOW:HIGH' with 0 <= LOW < HIGH.")
        return group


def parse_groups(specs: Sequence[str] | str | None) -> tuple[LengthGroup, ...]:
    """Parse and check ``filter_group``; an empty tuple means one folder, no length filter."""
    if specs is None:
        return ()
    if isinstance(specs, str):
        specs = [specs]
    groups = sorted(LengthGroup.parse(s) for s in specs)
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

    def __post_init__(self) -> None:
        if self.utts_per_file < 1:
            raise ConfigError(f"{option('utts_per_file', self.utts_per_file)}: a shard holds at least 1 utterance.")
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
    """Per scp row: its label row, frames (-1 unknown), shard ordinal (-1 dropped) and the row
    of the next distinct value that the scp lists in the same ark (-1 none; see ``successor``)."""

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
    next_row: np.ndarray | None = None
    frames_file_issues: dict[str, int] = field(default_factory=dict)  # utt2num_frames lines skipped, by reason

    @property
    def num_planned(self) -> int:
        return int((self.shard_of_row >= 0).sum())

    def successor(self, row: int) -> tuple[int, str] | None:
        """``(value offset, key)`` of the next value after ``row``'s that the scp lists in the
        same ark, for :meth:`MatrixReader.read`'s end check; None when there is none."""
        if self.next_row is None or self.next_row[row] < 0:
            return None
        following = int(self.next_row[row])
        key, value = self.scp.record(following)
        offset = parse_location(value, self.scp.where(following, key)).offset  # paths need no mapping here
        return None if offset is None else (offset, key)


def build_plan(
    scp_files: Sequence[Path],
    text_files: Sequence[Path],
    d_out: Path,
    options: PackOptions,
    progress: Callable[[str, int], Callable[[int], None]] | None = None,
) -> PackPlan:
    """Scan the inputs and decide every utterance's fate (see the module docstring)."""
    drops = SkipCounter(options.skip_bad)
    label_issues = SkipCounter(options.skip_bad)
    scan_progress = (
        progress("scan inputs", sum(Path(f).stat().st_size for f in [*scp_files, *text_files])) if progress else None
    )

    arks = _ArkPositions()

    def check_scp(key: str, value: str, where: Where) -> None:
        problem = key_problem(key)
        if problem and not (options.escape_keys and key):
            raise InputError(
                where,
                "bad_key",
                f"{problem}.",
                f"rename the utterance, or pass {option('escape_keys')} to store it percent-encoded.",
            )
        arks.add(options.location(value, where))  # the last check: a row follows for each call

    scp = KeyTable.scan(scp_files, drops, needs_value=True, check=check_scp, progress=scan_progress)
    next_row = arks.next_rows(len(scp))
    empty_labels: list[Where] = []

    def note_empty(key: str, value: str, where: Where) -> None:
        if not value:
            empty_labels.append(where)

    labels = KeyTable.scan(text_files, label_issues, needs_value=False, check=note_empty, progress=scan_progress)
    if empty_labels:  # kept (a silent recording may have none), but never unannounced
        _LOG.warning("%d label(s) are empty, packed as empty texts (first: %s)", len(empty_labels), empty_labels[0])
        label_issues.counts["empty_label"] = len(empty_labels)
    if len(scp) + scp.bad_lines == 0:
        raise InputError(
            Where(", ".join(map(str, scp_files))),
            "empty_input",
            "the scp files hold no entries.",
            "check that you gave the right feats.scp.",
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

    label_rows = labels.lookup(scp.hashes).astype(np.int32 if len(labels) < 2**31 else np.int64)
    for row in np.flatnonzero(keep & (label_rows < 0)):
        key = scp.record(int(row))[0]
        drops(
            InputError(
                scp.where(int(row), key),
                "no_label",
                "the utterance has features but no label in the text files.",
                "add its label.",
            )
        )
        keep[row] = False

    used = np.zeros(len(labels), dtype=bool)
    used[label_rows[keep]] = True
    unused = np.flatnonzero(~used & ~duplicate_labels)
    for number, row in enumerate(unused):
        key = labels.record(int(row))[0]
        label_issues(
            InputError(
                labels.where(int(row), key),
                "no_features",
                f"the label has no features in the scp files{_and_more(len(unused)) if number == 0 else ''}.",
                "add its features to the scp.",
            )
        )

    frames = np.full(len(scp), -1, dtype=np.int32)
    group_of_row = np.zeros(len(scp), dtype=np.int16)
    outside = 0
    frames_file_issues = SkipCounter(options.skip_bad, done="line ignored, length read from the ark")
    if options.groups:
        frames = _frames_of(scp, scp_files, keep, options, drops, frames_file_issues, progress)
        keep &= frames >= 0
        zero = keep & (frames == 0)
        for row in np.flatnonzero(zero):
            drops(
                InputError(
                    scp.where(int(row), scp.record(int(row))[0]),
                    "zero_length",
                    "the matrix has no frames.",
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
            entropy = [options.seed, group.low, group.high] if group else [options.seed]
            positions = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy))).permutation(len(rows))
        shard_in_group = positions // options.utts_per_file
        num_shards = math.ceil(len(rows) / options.utts_per_file)
        counts = np.bincount(shard_in_group, minlength=num_shards)
        folder = d_out / name if name else d_out
        first_ordinal = len(tasks)
        for index in range(num_shards):
            tasks.append(
                ShardTask(first_ordinal + index, name, index, folder / (options.fmt % index), int(counts[index]))
            )
        shard_of_row[rows] = first_ordinal + shard_in_group

    dropped = dict(drops.counts)
    if outside:
        dropped["outside_groups"] = outside
    return PackPlan(
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
        next_row,
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


class _ArkPositions:
    """Per scp row, its ark (a small number per distinct path) and value offset, gathered
    while the scp is scanned, in compact arrays (no Python object per row)."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self.arks = array("i")
        self.offsets = array("q")

    def add(self, location: ArkLocation) -> None:
        if location.is_pipe or location.offset is None:
            self.arks.append(-1)  # no ark position: a command, or a file holding one object
            self.offsets.append(0)
            return
        self.arks.append(self._ids.setdefault(location.path, len(self._ids)))
        self.offsets.append(location.offset)

    def next_rows(self, num_rows: int) -> np.ndarray:
        """For each row, the first row (in scp order) of the next distinct value start after
        its own in the same ark, else -1. Rows sharing one offset (different Kaldi ranges of
        one matrix) share a value and so a successor. Empties the collector."""
        if len(self.arks) != num_rows:
            raise RuntimeError(f"{len(self.arks)} ark positions for {num_rows} scp rows; please report this.")
        dtype = np.int32 if num_rows < 2**31 else np.int64
        arks = np.frombuffer(self.arks, dtype=np.int32) if num_rows else np.empty(0, np.int32)
        offsets = np.frombuffer(self.offsets, dtype=np.int64) if num_rows else np.empty(0, np.int64)
        self.arks, self.offsets, self._ids = array("i"), array("q"), {}  # freed with the views below
        next_row = np.full(num_rows, -1, dtype=dtype)
        rows = np.flatnonzero(arks >= 0).astype(dtype)
        if not len(rows):
            return next_row
        order = rows[np.lexsort((offsets[rows], arks[rows]))]  # stable: scp order within one offset
        del rows
        sorted_arks, sorted_offsets = arks[order], offsets[order]
        starts_value = np.ones(len(order), dtype=bool)
        starts_value[1:] = (sorted_arks[1:] != sorted_arks[:-1]) | (sorted_offsets[1:] != sorted_offsets[:-1])
        del sorted_offsets
        firsts = np.flatnonzero(starts_value)  # the first sorted position of each distinct value
        successor = np.full(len(firsts), -1, dtype=dtype)  # per distinct value
        same_ark = sorted_arks[firsts[1:]] == sorted_arks[firsts[:-1]]
        successor[:-1][same_ark] = order[firsts[1:][same_ark]]
        del sorted_arks, same_ark, firsts
        value_of = np.cumsum(starts_value, dtype=np.int64) - 1
        del starts_value
        next_row[order] = successor[value_of]
        return next_row


def _and_more(count: int) -> str:
    return f" ({count - 1} more labels have the same problem)" if count > 1 else ""


def _frames_of(
    scp: KeyTable,
    scp_files: Sequence[Path],
    keep: np.ndarray,
    options: PackOptions,
    drops: SkipCounter,
    frames_file_issues: SkipCounter,
    progress: Callable[[str, int], Callable[[int], None]] | None,
) -> np.ndarray:
    """Frames per scp row (-1 for rows that could not be read), from ``utt2num_frames``
    files when present (next to each scp, or given) and from matrix headers otherwise.

    A malformed ``utt2num_frames`` line stops the pack, or when skipping is counted in
    ``frames_file_issues``; its utterance's length then comes from the matrix header."""
    frames = np.full(len(scp), -1, dtype=np.int32)
    count_files = [Path(f) for f in options.num_frames_files] or [
        Path(f).parent / NUM_FRAMES_FILE for f in scp_files if (Path(f).parent / NUM_FRAMES_FILE).is_file()
    ]
    if count_files:
        counts = KeyTable.scan(sorted(set(count_files)), frames_file_issues, number=True)
        found = counts.lookup(scp.hashes)
        assert counts.values is not None
        frames[found >= 0] = counts.values[found[found >= 0]]
        _LOG.info("frame counts from %s", ", ".join(map(str, sorted(set(count_files)))))
    missing = np.flatnonzero(keep & (frames < 0))
    if len(missing):
        advance = progress("read matrix headers", len(missing)) if progress else None
        with MatrixReader(allow_pipes=options.allow_pipes) as reader:
            for row in missing:
                key, value = scp.record(int(row))
                where = scp.where(int(row), key)
                try:
                    frames[row] = reader.shape(options.location(value, where), where)[0]
                except InputError as error:
                    drops(error)
                if advance:
                    advance(1)
    return frames
