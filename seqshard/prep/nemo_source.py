"""``pack --manifest``: the utterances of NeMo manifests (``formats/peers/nemo.py``).

A manifest line is an utterance: its key (the entry's ``id``, else from its file's name and
offset), its audio (a whole file, or ``duration`` seconds from ``offset``: the rules of a
``wav.scp`` cut by ``segments``, lossy audio kept as its original bytes), its text, and on
request (``fields``) its other keys as fields ``NAME.json``. Lengths come from the manifest's
durations, so planning length groups reads no audio. The manifests are both the source's
table and its labels: no text files.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..errors import SkipCounter, Where
from ..formats.audio import Audio, WavLocation, cut, decode_audio, read_location
from ..formats.peers.keytable import KeyTable
from ..formats.peers.nemo import audio_path, parse_entry, parse_keyed, parse_text
from .plan import PackOptions, PackPlan
from .sources import AudioSource, Members, Progress, _AudioReader, check_key, field_members


class ManifestSource(AudioSource):
    """Audio and texts named by NeMo manifest file(s)."""

    durations = "the manifest's duration", "correct the entry's duration (NeMo reads that many seconds)."

    def __init__(self, manifests: Sequence[Path], options: PackOptions):
        super().__init__(manifests, [], options)

    def scan(self, drops: SkipCounter, progress: Callable[[int], None] | None) -> KeyTable:
        def check(key: str, value: str, where: Where) -> None:
            check_key(key, where, self.options)

        return KeyTable.scan(self.files, drops, needs_value=True, check=check, progress=progress, parse=parse_keyed)

    def scan_labels(self, issues: SkipCounter, check: Callable[[str, str, Where], None]) -> KeyTable:
        """The entries' texts, as the pack's labels."""
        return KeyTable.scan(self.files, issues, needs_value=False, check=check, parse=parse_text)

    def lengths(
        self, table: KeyTable, keep: np.ndarray, drops: SkipCounter, issues: SkipCounter, progress: Progress
    ) -> np.ndarray:
        """Length per row in 10 ms frames, from the entries' durations (no audio is read)."""
        frames = np.full(len(table), -1, dtype=np.int32)
        for row in map(int, np.flatnonzero(keep)):
            key, value = table.record(row)
            frames[row] = round(parse_entry(value, table.where(row, key)).duration * 100)
        return frames

    def reader(self, plan: PackPlan, dim: int) -> _ManifestReader:
        return _ManifestReader(self, plan, dim)


class _ManifestReader(_AudioReader):
    """Reads planned entries' audio (a cut entry's file is decoded once for its next cuts)."""

    def _utterance(self, key: str, value: str, where: Where) -> tuple[bytes | None, Audio]:
        entry = parse_entry(value, where)
        path = audio_path(entry.audio, where.path)
        if entry.segment is None:
            data = read_location(WavLocation(path), where)
            return data, decode_audio(data, where, self.options.channel)
        if self._last is None or self._last[0] != path:
            data = read_location(WavLocation(path), where)
            self._last = (path, decode_audio(data, where, self.options.channel))
        return None, cut(self._last[1], *entry.segment, where)

    def read(self, row: int, key: str, value: str, where: Where) -> tuple[Members, int, str | None]:
        members, frames, how = super().read(row, key, value, where)
        if self.options.fields:
            members += field_members(parse_entry(value, where).record, self.options.fields, where)
        return members, frames, how
