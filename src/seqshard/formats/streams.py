"""Sample streams over what the loader reads: tar shards, WeNet raw lists and NeMo manifests
read as shards, the files of Lhotse Shar folders (``formats/peers/shar.py``) and the tars of NeMo
tarred sets (``formats/peers/nemo_tarred.py``).

All have the same interface (``next_sample()``, ``resume_offset``, ``ordinal``,
``ended_cleanly``), so planning, splitting, skipping and resuming treat them alike.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import ShardError
from .members import has_table_format, load_table
from .patterns import is_list_name, is_manifest_name
from .peers.lists import READ_ERROR_FIELD, ListSampleStream
from .peers.nemo import ManifestSampleStream
from .peers.nemo_tarred import NemoTarStream, nemo_shard_of
from .peers.shar import CutStream, FieldTarStream, JsonlFieldStream, open_shar, shar_field_of
from .remote.access import RemoteAccess, is_remote
from .sliced import SlicedSampleStream
from .tar import SampleStream

AnyStream = (
    SampleStream | SlicedSampleStream | ListSampleStream | CutStream | JsonlFieldStream | FieldTarStream | NemoTarStream
)


def open_samples(
    path: str | Path,
    start: int = 0,
    ordinal: int = 0,
    read_data: bool = True,
    read_ahead: bool = True,
    access: RemoteAccess | None = None,
    use_table: bool = True,
    path_root: str | None = None,
) -> AnyStream:
    """A sample stream over a shard (or a raw list), from byte ``start`` (sample ``ordinal``);
    ``access`` reads remote shards (and reads local ones ahead). A local tar with a member
    table is sliced by it (``formats/members.py``) unless ``use_table=False``. A list's
    relative paths are taken from ``path_root`` when given."""
    if is_manifest_name(str(path)):
        return ManifestSampleStream(path, start, ordinal, read_data=read_data, path_root=path_root)
    if is_list_name(str(path)):
        return ListSampleStream(path, start, ordinal, read_data=read_data, path_root=path_root)
    if (shar_field := shar_field_of(str(path))) is not None:
        return open_shar(str(path), shar_field, start, ordinal, read_data, read_ahead)
    if not is_remote(str(path)) and (nemo := nemo_shard_of(path)) is not None:
        return NemoTarStream(path, *nemo, start, ordinal, read_data, read_ahead)
    table = load_table(path) if use_table and has_table_format(str(path)) else None
    if table is not None:
        return SlicedSampleStream(str(path), table, start, ordinal, read_data, read_ahead, access)
    return SampleStream(path, start, ordinal, read_data=read_data, read_ahead=read_ahead, access=access)


def skip_samples(path: str | Path, count: int, access: RemoteAccess | None = None) -> tuple[int, int]:
    """Offset of the ``count``-th sample, found by reading headers only (lines of a list), or
    a member table checked against them.

    Returns ``(offset, ordinal)`` to pass to :func:`open_samples`; the ordinal is smaller than
    ``count`` when there are fewer samples.
    """
    if count == 0:
        return 0, 0
    with open_samples(path, read_data=False, access=access) as stream:
        for _ in range(count):
            if stream.next_sample() is None:
                break
        return stream.resume_offset, stream.ordinal


def count_samples(path: str | Path, access: RemoteAccess | None = None) -> int:
    """How many samples a shard (or list) holds, found by reading its headers only."""
    with open_samples(path, read_data=False, access=access) as stream:
        while stream.next_sample() is not None:
            pass
        return stream.ordinal


def first_sample_fields(path: str | Path, access: RemoteAccess | None = None) -> list[str]:
    """Member suffixes of the first sample (empty for an empty or unreadable shard: reading
    it later reports the damage)."""
    try:
        with open_samples(path, read_data=False, access=access) as stream:
            sample = stream.next_sample()
    except ShardError:
        return []
    if sample is None:
        return []
    fields = [name for name in sample.fields if name != READ_ERROR_FIELD]  # a bad list line: told when read
    return fields or ["wav", "txt"]  # a list's samples (audio and text) are only named when read


def same_keys(path: str | Path, other: str | Path) -> bool:
    """Whether two shards hold the same keys in the same order (read by their headers; False
    when either cannot be read): what makes a file a field file of a shard."""
    try:
        with (
            open_samples(path, read_data=False, read_ahead=False) as one,
            open_samples(other, read_data=False, read_ahead=False) as two,
        ):
            while True:
                first, second = one.next_sample(), two.next_sample()
                if first is None or second is None:
                    return first is None and second is None
                if first.key != second.key:
                    return False
    except ShardError:
        return False
