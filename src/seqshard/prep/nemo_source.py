"""``pack --manifest``: the utterances of NeMo manifests (``formats/peers/nemo.py``).

A manifest line is an utterance: its key (the entry's ``id``, else from its file's name and
offset), its audio (a whole file, or ``duration`` seconds from ``offset``: the rules of a
``wav.scp`` cut by ``segments``, lossy audio kept as its original bytes), its text, and on
request (``fields``) its other keys as fields ``NAME.json``. Lengths come from the manifest's
durations, so planning length groups reads no audio. The manifests are both the source's
table and its labels: no text files.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ..errors import Where
from ..formats.audio import DecodedAudio, WavLocation, cut, decode_audio, read_location
from ..formats.peers.nemo import audio_path, parse_entry, parse_keyed, parse_text
from .inputs import AudioSource, Members, Utterance, _AudioReader, check_key, field_members
from .job import PackOptions


class ManifestSource(AudioSource):
    """Audio and texts named by NeMo manifest file(s)."""

    texts_inside = True
    parse = staticmethod(parse_keyed)
    parse_label = staticmethod(parse_text)
    durations = "the manifest's duration", "correct the entry's duration (NeMo reads that many seconds)."

    def __init__(self, manifests: Sequence[Path], options: PackOptions):
        super().__init__(manifests, [], options)

    def check(self, key: str, value: str, where: Where) -> None:
        check_key(key, where, self.options)

    def length_files(self) -> tuple[list[Path], bool]:
        return [], True  # the entries' durations say

    def length(self, measurer: object, key: str, value: str, where: Where) -> int:
        """Length in 10 ms frames, from the entry's duration (no audio is read)."""
        return round(parse_entry(value, where).duration * 100)

    def reader(self, dim: int) -> _ManifestReader:
        return _ManifestReader(self, dim)


MANIFEST_FIX = "fix the entry's offset and duration (seconds) in the manifest."


class _ManifestReader(_AudioReader):
    """Reads planned entries' audio (a cut entry's file is decoded once for its next cuts)."""

    def _utterance(self, key: str, value: str, where: Where) -> tuple[bytes | None, DecodedAudio]:
        entry = parse_entry(value, where)
        path = audio_path(entry.audio, where.path)
        if entry.segment is None:
            data = read_location(WavLocation(path), where)
            return data, decode_audio(data, where, self.options.channel)
        if self._last is None or self._last[0] != path:
            data = read_location(WavLocation(path), where)
            self._last = (path, decode_audio(data, where, self.options.channel))
        return None, cut(self._last[1], *entry.segment, where, MANIFEST_FIX)

    def read(self, utterance: Utterance) -> tuple[Members, int, str | None]:
        members, frames, how = super().read(utterance)
        if self.options.fields:
            members += field_members(
                parse_entry(utterance.value, utterance.where).record, self.options.fields, utterance.where
            )
        return members, frames, how
