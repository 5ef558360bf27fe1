"""``pack --utt2spk utt2spk --cmvn-scp cmvn.scp``: each utterance's speaker (``KEY.spk.txt``) and
its speaker's Kaldi CMVN statistics (``KEY.cmvn.npy``, the matrix ``cmvn.scp`` names, as
``compute-cmvn-stats --spk2utt`` wrote it), for ``make_loader(cmvn="speaker")``.

As ``apply-cmvn`` finds them: the statistics of an utterance are those of its speaker in
``utt2spk``, or, without ``utt2spk``, its own (a ``cmvn.scp`` keyed by utterance). Every
speaker's statistics travel with each of its utterances (a few hundred bytes beside features
of tens of kilobytes), so any selection of shards, local or remote, normalizes alone.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError, SkipCounter, Where
from ..features.speaker_cmvn import SPEAKER_FIELD, STATS_FIELD, stats_problem
from ..formats.npy import npy_parts
from ..formats.peers.kaldi import ArkLocation, MatrixReader
from ..formats.peers.keytable import KeyTable

Locate = Callable[[str, Where], ArkLocation]  # a cmvn.scp value -> where its matrix is (PackOptions.location)

SPEAKER_MEMBER, STATS_MEMBER = f"{SPEAKER_FIELD}.txt", f"{STATS_FIELD}.npy"
CACHED_SPEAKERS = 4096  # statistics kept encoded per writer, the most recent speakers'


class Speakers:
    """``utt2spk`` and/or ``cmvn.scp`` of a pack (either may be None, not both); ``locate``
    and ``allow_pipes`` read the statistics as the pack's options say."""

    def __init__(self, utt2spk: Path | None, cmvn_scp: Path | None, locate: Locate, allow_pipes: bool):
        refuse = SkipCounter(False)  # a malformed or repeated line stops the pack: ids would be guessed
        self.locate, self.allow_pipes = locate, allow_pipes
        self.utt2spk = KeyTable.scan([utt2spk], refuse, check=_one_word) if utt2spk else None
        self.stats = KeyTable.scan([cmvn_scp], refuse) if cmvn_scp else None
        for table, name in ((self.utt2spk, "utterance"), (self.stats, "speaker")):
            if table is not None:
                table.report_repeats(
                    refuse, "duplicate_key", f"the {name} was already given at {{first}}.", "remove the repeat."
                )
        self._reader: MatrixReader | None = None
        self._encoded: dict[str, list[Any]] = {}

    @property
    def files(self) -> list[Path]:
        return [table.files[0] for table in (self.utt2spk, self.stats) if table is not None]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_reader": None, "_encoded": {}}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        for table in (self.utt2spk, self.stats):
            if table is not None:
                table.close()

    def members(self, key: str, where: Where, dim: int) -> list[tuple[str, list[Any]]]:
        """The utterance's speaker and statistics members; InputError (``no_speaker``,
        ``no_cmvn``, ``bad_cmvn``) naming the file and line at fault. ``dim`` (0: not known
        before the loader computes features) is the features' dimension the statistics must fit."""
        speaker = self.speaker(key, where)
        members: list[tuple[str, list[Any]]] = []
        if self.utt2spk is not None:
            members.append((SPEAKER_MEMBER, [speaker.encode("utf-8")]))
        if self.stats is not None:
            members.append((STATS_MEMBER, self._statistics(speaker, where, dim)))
        return members

    def speaker(self, key: str, where: Where) -> str:
        if self.utt2spk is None:
            return key  # apply-cmvn without --utt2spk: statistics keyed by utterance
        found = self.utt2spk.find(key)
        if found is None:
            raise InputError(
                where,
                "no_speaker",
                f"the utterance has no speaker in {self.utt2spk.files[0]}.",
                "add its line to utt2spk (utils/fix_data_dir.sh keeps the files of a data dir in step).",
            )
        return found[1]

    def _statistics(self, speaker: str, where: Where, dim: int) -> list[Any]:
        encoded = self._encoded.get(speaker)
        if encoded is not None:
            return encoded
        assert self.stats is not None
        found = self.stats.find(speaker)
        whose = f"speaker {speaker!r}" if self.utt2spk is not None else "the utterance"
        if found is None:
            raise InputError(
                where,
                "no_cmvn",
                f"{whose} has no statistics in {self.stats.files[0]}.",
                "compute them for every speaker (steps/compute_cmvn_stats.sh), or pass the cmvn.scp made with this "
                "utt2spk.",
            )
        row, value = found
        at = self.stats.where(row, speaker)
        if self._reader is None:
            self._reader = MatrixReader(allow_pipes=self.allow_pipes)
        stats = self._reader.read(self.locate(value, at), at)
        problem = stats_problem(np.asarray(stats), dim or None)
        if problem is not None:
            raise InputError(at, "bad_cmvn", f"{problem}.", "compute the statistics again with compute-cmvn-stats.")
        if len(self._encoded) >= CACHED_SPEAKERS:
            self._encoded.clear()
        encoded = self._encoded[speaker] = list(npy_parts(np.ascontiguousarray(stats, dtype=np.float64)))
        return encoded

    def check(self, utterances: Iterable[tuple[str, Where]], dim: int) -> None:
        """Every planned utterance's speaker and statistics (its key, and where its line is),
        before a shard is written (the first problem raises; the writers count them when skipping)."""
        try:
            for key, where in utterances:
                self.members(key, where, dim)
        finally:
            if self._reader is not None:  # writer processes open their own (an open file's offset is shared)
                self._reader.close()
                self._reader = None


def _one_word(key: str, value: str, where: Where) -> None:
    if len(value.split()) != 1:
        raise InputError(where, "malformed_line", f"expected 'UTTERANCE SPEAKER', found a speaker of {value!r}.")
