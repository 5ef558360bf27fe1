"""``pack --utt2spk utt2spk --cmvn-scp cmvn.scp``: each utterance's speaker (``KEY.spk.txt``) and
its speaker's Kaldi CMVN statistics (``KEY.cmvn.npy``, the matrix ``cmvn.scp`` names, as
``compute-cmvn-stats --spk2utt`` wrote it), for ``make_loader(cmvn="speaker")``.

As ``apply-cmvn`` finds them: the statistics of an utterance are those of its speaker in
``utt2spk``, or, without ``utt2spk``, its own (a ``cmvn.scp`` keyed by utterance). Every
speaker's statistics travel with each of its utterances (a few hundred bytes beside features
of tens of kilobytes), so any selection of shards, local or remote, normalizes alone.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """The speakers' statistics of a pack (``cmvn_scp``, keyed by speaker, or by utterance
    without ``utt2spk``) and the members they add to each utterance; ``locate`` and
    ``allow_pipes`` read the statistics as the pack's options say. Which utterance is whose is
    joined by key in the pack's bucket wave (``buckets.py``)."""

    def __init__(self, utt2spk: Path | None, cmvn_scp: Path | None, locate: Locate, allow_pipes: bool):
        self.utt2spk, self.cmvn_scp = utt2spk, cmvn_scp
        self.locate, self.allow_pipes = locate, allow_pipes
        self._stats: KeyTable | None = None
        self._reader: MatrixReader | None = None
        self._encoded: dict[str, list[Any]] = {}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_stats": None, "_reader": None, "_encoded": {}}

    @property
    def stats(self) -> KeyTable | None:
        """``cmvn.scp``, scanned once per process: a malformed or repeated line stops the pack."""
        if self._stats is None and self.cmvn_scp is not None:
            refuse = SkipCounter(False)
            self._stats = KeyTable.scan([self.cmvn_scp], refuse)
            self._stats.report_repeats(
                refuse, "duplicate_key", "the speaker was already given at {first}.", "remove the repeat."
            )
        return self._stats

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None
        if self._stats is not None:
            self._stats.close()

    def has_statistics(self, speaker: str) -> bool:
        return self.stats is None or self.stats.find(speaker) is not None

    def missing(self, speaker: str, where: Where) -> InputError:
        """The error of an utterance whose speaker has no statistics."""
        whose = f"speaker {speaker!r}" if self.utt2spk is not None else "the utterance"
        return InputError(
            where,
            "no_cmvn",
            f"{whose} has no statistics in {self.cmvn_scp}.",
            "compute them for every speaker (steps/compute_cmvn_stats.sh), or pass the cmvn.scp made with this "
            "utt2spk.",
        )

    def members(self, speaker: str, where: Where, dim: int) -> list[tuple[str, list[Any]]]:
        """The utterance's speaker and statistics members (``speaker``: its speaker, or its key
        without utt2spk); InputError (``no_cmvn``, ``bad_cmvn``) naming the file and line at
        fault. ``dim`` (0: not known before the loader computes features) is the features'
        dimension the statistics must fit."""
        members: list[tuple[str, list[Any]]] = []
        if self.utt2spk is not None:
            members.append((SPEAKER_MEMBER, [speaker.encode("utf-8")]))
        if self.cmvn_scp is not None:
            members.append((STATS_MEMBER, self._statistics(speaker, where, dim)))
        return members

    def _statistics(self, speaker: str, where: Where, dim: int) -> list[Any]:
        encoded = self._encoded.get(speaker)
        if encoded is not None:
            return encoded
        assert self.stats is not None
        found = self.stats.find(speaker)
        if found is None:
            raise self.missing(speaker, where)
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

    def check_all(self, dim: int) -> None:
        """Every speaker's statistics, before a shard is written (the first problem raises; the
        writers count them when skipping)."""
        if self.stats is None:
            return
        try:
            for row in range(len(self.stats)):
                speaker, _ = self.stats.record(row)
                self._statistics(speaker, self.stats.where(row, speaker), dim)
        finally:
            self._encoded.clear()
            if self._reader is not None:  # writer processes open their own (an open file's offset is shared)
                self._reader.close()
                self._reader = None
