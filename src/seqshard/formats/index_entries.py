"""The entries of a shard index (``index.py``): a shard's entry and its sidecars', the bounds
of every number an entry holds, the length histogram's bins, and the names a folder's files
may have (names read from data never point outside their folder)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..checks import read_number, shown
from ..errors import SeqshardError
from .inflation import inflation_limit
from .patterns import FIELD_SET_NAME, FIELDS_DIR, shard_stem

BINS_PER_OCTAVE = 8


def sidecar_name(shard_name: str, field_set: str) -> str:
    """The file of field set ``field_set`` of shard ``shard_name``, relative to the shard's
    folder: ``fields/NAME/STEM.tar``."""
    return f"{FIELDS_DIR}/{field_set}/{shard_stem(shard_name)}.tar"


def old_sidecar_name(shard_name: str, field_set: str) -> str:
    """Where ``add-field`` put that file before: ``STEM.NAME.tar`` beside the shard."""
    return f"{shard_stem(shard_name)}.{field_set}.tar"


def check_name(name: Any, where: str | Path, what: str, fix: str) -> str:
    """``name``, read from data (an index, a pack's plan), if it is a plain file name: a
    non-empty string without ``/``, ``\\`` or NUL, other than ``.`` and ``..``, so that it
    cannot point outside its folder. Else a SeqshardError naming ``where``, ``what`` and ``fix``."""
    if not isinstance(name, str) or name in ("", ".", "..") or any(c in name for c in "/\\\0"):
        raise SeqshardError(
            f"{where}: {what} is named {name!r}, not a plain file name: it could point outside its folder. {fix}"
        )
    return name


def length_bin(frames: int) -> int:
    """Histogram bin of an utterance of ``frames`` frames (frames >= 1)."""
    return math.floor(math.log2(max(frames, 1)) * BINS_PER_OCTAVE + 1e-9)


def bin_bounds(index: int) -> tuple[float, float]:
    """Lengths covered by a bin: ``[low, high)``."""
    return bin_length(index), bin_length(index + 1)


def bin_length(position: Any) -> Any:
    """The length ``position`` bins up (a bin's low end at its index, its geometric middle,
    which stands for its utterances, at index + 0.5); elementwise over numpy arrays."""
    return 2 ** (position / BINS_PER_OCTAVE)


def merge_histograms(histograms: Iterable[dict[int, int]]) -> dict[int, int]:
    total: dict[int, int] = {}
    for histogram in histograms:
        for index, count in histogram.items():
            total[index] = total.get(index, 0) + count
    return dict(sorted(total.items()))


def histogram_percentile(histogram: dict[int, int], q: float) -> float:
    """Length at percentile ``q`` (0-100), interpolated geometrically inside its bin."""
    total = sum(histogram.values())
    if total == 0:
        return 0.0
    target = q / 100 * total
    seen = 0
    for index in sorted(histogram):
        count = histogram[index]
        if seen + count >= target:
            return bin_length(index + ((target - seen) / count if count else 0.0))
        seen += count
    return bin_bounds(max(histogram))[1]


@dataclass
class SidecarEntry:
    """The file of one field set of a shard (``name`` relative to the shard's folder)."""

    name: str
    bytes: int
    checksum: str
    first_key: str | None = None  # None in indexes written before keys were recorded
    last_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> SidecarEntry:
        """The entry read from an index (ValueError naming the field that is not what it must be)."""
        entry = as_mapping(entry, "a sidecar")
        return cls(
            text_field(entry, "name"),
            count_field("bytes", entry.get("bytes"), MAX_BYTES),
            text_field(entry, "checksum"),
            text_field(entry, "first_key", optional=True),
            text_field(entry, "last_key", optional=True),
        )


@dataclass
class FieldSet:
    """A field set added beside the shards: its member suffixes and where it came from."""

    fields: list[str]
    source: str = ""
    created: str = ""
    allow_missing: bool = False
    digest: str = ""  # of the source's kind and content: adding the same again changes nothing
    layout: dict[str, Any] = field(default_factory=dict)  # an array field's {"dtype", "shape"} (after its first axis)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FieldSet:
        """The field set read from an index (ValueError naming the field that is not what it must be)."""
        data = as_mapping(data, "a field set")
        layout = as_mapping(data.get("layout") or {}, "its layout")
        if layout:
            shape = layout.get("shape")
            if not isinstance(layout.get("dtype"), str) or not isinstance(shape, list):
                raise ValueError(f'its layout is {shown(layout)}, not {{"dtype": "NAME", "shape": [SIZE, ...]}}')
            for size in shape:
                read_number("a size in its layout's shape", size, whole=True, at_least=0, at_most=MAX_COUNT)
            try:
                np.dtype(layout["dtype"])
            except TypeError:
                raise ValueError(f"its layout's dtype is {shown(layout['dtype'])}, not a numpy dtype") from None
        return cls(
            texts_field(data, "fields"),
            text_field(data, "source", default=""),
            text_field(data, "created", default=""),
            flag_field(data, "allow_missing"),
            text_field(data, "digest", default=""),
            dict(layout),
        )


@dataclass
class ShardEntry:
    """One shard of a folder."""

    name: str
    num_utts: int
    num_frames: int
    bytes: int
    checksum: str
    length_hist: dict[int, int] = field(default_factory=dict)
    min_frames: int | None = None  # exact, for percentiles clamped to the real range
    max_frames: int | None = None
    sidecars: dict[str, SidecarEntry] = field(default_factory=dict)  # field set -> its file
    first_key: str | None = None  # as stored (escaped keys escaped); None in older indexes
    last_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry = asdict(self)
        entry["length_hist"] = {str(k): v for k, v in sorted(self.length_hist.items())}
        entry["sidecars"] = {name: car.to_json() for name, car in self.sidecars.items()}
        return {k: v for k, v in entry.items() if (v is not None and v != {}) or k == "length_hist"}

    @classmethod
    def from_json(cls, entry: dict[str, Any]) -> ShardEntry:
        """The entry read from an index or a pack journal: every number checked (a whole number,
        in range, and consistent: no more utterances than the shard's bytes can hold, frames
        between the shortest and longest length times the count); ValueError naming the field."""
        entry = as_mapping(entry, "a shard entry")
        name = entry.get("name")
        size = count_field("bytes", entry.get("bytes"), MAX_BYTES)
        utts = count_field("num_utts", entry.get("num_utts"), MAX_LENGTH)
        if utts > max_samples(name if isinstance(name, str) else "", size):
            raise ValueError(f"num_utts is {utts} but bytes is {size}: a shard holds at most one sample per 512 bytes")
        frames = count_field("num_frames", entry.get("num_frames"))
        shortest, longest = (
            None if entry.get(f) is None else count_field(f, entry[f], MAX_LENGTH) for f in ("min_frames", "max_frames")
        )
        histogram = {}
        for bin_, count in as_mapping(entry.get("length_hist", {}), "its length_hist").items():
            if not isinstance(bin_, str) or not bin_.isdecimal() or int(bin_) > MAX_BIN:
                raise ValueError(f"length_hist has a bin {shown(bin_)}, not a number from 0 to {MAX_BIN}")
            histogram[int(bin_)] = count_field(f"length_hist[{bin_!r}]", count, utts)
        measured = sum(histogram.values())  # the utterances whose length is known
        if measured > utts:
            raise ValueError(f"length_hist counts {measured} utterances where num_utts is {utts}")
        if (
            shortest is not None
            and longest is not None
            and not (shortest <= longest and measured * shortest <= frames <= measured * longest)
        ):
            raise ValueError(
                f"num_frames {frames}, min_frames {shortest} and max_frames {longest} do not fit {measured} utterances"
            )
        return cls(
            name=name,  # type: ignore[arg-type]  # checked by check_names
            num_utts=utts,
            num_frames=frames,
            bytes=size,
            checksum=text_field(entry, "checksum"),
            length_hist=histogram,
            min_frames=shortest,
            max_frames=longest,
            sidecars={
                k: SidecarEntry.from_json(v) for k, v in as_mapping(entry.get("sidecars", {}), "its sidecars").items()
            },
            first_key=text_field(entry, "first_key", optional=True),
            last_key=text_field(entry, "last_key", optional=True),
        )

    def check_names(self, where: str | Path, number: int, fix: str) -> None:
        """Refuse a name that could point outside the folder (see the module docstring):
        ``where`` is the index file, ``number`` the entry's position in it."""
        what = f"shard entry {number}"
        check_name(self.name, where, what, fix)
        for field_set, car in self.sidecars.items():
            if not FIELD_SET_NAME.fullmatch(field_set):
                raise SeqshardError(f"{where}: {what} ({self.name}) has a field set named {field_set!r}. {fix}")
            if car.name not in (sidecar_name(self.name, field_set), old_sidecar_name(self.name, field_set)):
                raise SeqshardError(
                    f"{where}: {what} ({self.name}) puts its field set {field_set!r} in {car.name!r}, not in "
                    f"{sidecar_name(self.name, field_set)!r} where add-field writes it. {fix}"
                )


MAX_BYTES = 1 << 56  # a size in bytes beyond this is not a file's
MAX_COUNT = 1 << 53  # counts of utterances and frames beyond this are not a dataset's
MAX_DIM = 1 << 20  # a frame of more values is not a feature vector (a model's input layer would not fit)
MAX_LENGTH = (1 << 31) - 1  # an utterance's length and a shard's utterance count are int32 wherever they are kept
MAX_SECONDS = MAX_LENGTH // 100  # an utterance's seconds: its length in 10 ms frames fits int32 (about 248 days)
MAX_BIN = 31 * BINS_PER_OCTAVE - 1  # the bin of a length of MAX_LENGTH frames


def max_samples(name: str, size: int) -> int:
    """The most samples a shard file ``name`` of ``size`` bytes can hold: each has a 512-byte
    tar header (a gzip'd shard inflates within the rule of ``inflation.py``)."""
    if name.endswith((".gz", ".tgz")):
        size = inflation_limit(size, capped=False)
    return size // 512


def count_field(field: str, value: Any, at_most: int = MAX_COUNT) -> int:
    """A whole number from 0 to ``at_most`` read from an index (NumberError naming ``field``)."""
    if type(value) is int and 0 <= value <= at_most:  # nearly every number: checked without a call (500,000 shards)
        return value
    return int(read_number(field, value, whole=True, at_least=0, at_most=at_most))  # type: ignore[arg-type]


def as_mapping(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is {shown(value)}, not a JSON object")
    return value


def text_field(data: dict[str, Any], field: str, optional: bool = False, default: str | None = None) -> Any:
    """``data[field]``, a string (None when ``optional`` and absent; ``default`` when given and absent)."""
    value = data.get(field, default)
    if isinstance(value, str) or (value is None and optional):
        return value
    raise ValueError(f"{field} is {shown(value)}, not a string")


def texts_field(data: dict[str, Any], field: str) -> list[str]:
    value = data.get(field, [])
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise ValueError(f"{field} is {shown(value)}, not a list of strings")
    return list(value)


def flag_field(data: dict[str, Any], field: str) -> bool:
    value = data.get(field, False)
    if not isinstance(value, bool):
        raise ValueError(f"{field} is {shown(value)}, not true or false")
    return value
