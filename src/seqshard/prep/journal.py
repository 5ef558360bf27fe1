"""The pack journal: which shards are finished, and how far unfinished ones got, kept in
``OUT/.seqshard-pack/``.

Each writer process appends one JSON line per shard after the shard has been renamed to its
final name. A rerun of the same command trusts a shard only when it has both its file (of the
recorded size) and its journal line, and writes every other shard again. A shard whose planned
utterances were all dropped while writing is journaled with 0 bytes and has no file (an empty
shard is never given its final name): it is finished when no file has its name.

A shard still being written is checkpointed now and then (``partial-ORDINAL.json``: how many
of its planned utterances its hidden partial file holds, in how many bytes, after an fsync of
those bytes), so that a rerun continues it from there instead of from its first utterance.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from ..errors import InputError, SeqshardError
from ..formats.files import inside, open_output, read_json, write_json_atomic, writing
from ..formats.inflation import numbered_lines
from ..formats.pack_state import STATE_DIR


class Journal:
    """Append-only journal file of one writer process (``kind``: ``journal`` for the pack's
    shards, ``field-NAME`` for the sidecar files of field set NAME)."""

    def __init__(self, d_out: Path, name: str, kind: str = "journal"):
        self.root = Path(d_out)
        folder = self.root / STATE_DIR
        self.path = inside(d_out, folder / f"{kind}-{name}.jsonl")
        with writing(folder):
            folder.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        descriptor = open_output(self.path, append=True)
        try:
            with writing(self.path):
                os.write(descriptor, line)
                os.fsync(descriptor)
        finally:
            os.close(descriptor)


def finished_shards(d_out: Path, kind: str = "journal") -> dict[str, dict[str, Any]]:
    """Records of shards (or sidecar files) that are complete on disk, keyed by path relative
    to ``d_out``."""
    records: dict[str, dict[str, Any]] = {}
    for _, record in journal_records(d_out, kind):
        if not (isinstance(record.get("name"), str) and isinstance(record.get("bytes"), int)):
            continue  # not a line seqshard wrote: its shard is not taken as finished
        relative = record_path(record)
        path = Path(d_out) / relative
        if _on_disk_as_recorded(path, record):
            records[relative] = record
    return records


def journal_records(d_out: Path, kind: str = "journal") -> Iterator[tuple[Path, dict[str, Any]]]:
    """``(journal file, record)`` of every whole line of the journals of ``kind``; a line
    that is no JSON object (cut short by a crash, or damaged; one too long is never held) is
    passed over: its shard is written again."""
    for journal in sorted((Path(d_out) / STATE_DIR).glob(f"{kind}-*.jsonl")):
        if not journal.is_file():  # a FIFO would hold the reader forever
            raise SeqshardError(
                f"{journal}: not a regular file, so not a journal seqshard wrote. Fix: remove it, then run the command again."
            )
        for _, _, line in numbered_lines(journal):
            try:
                record = json.loads(line) if isinstance(line, bytes) else None
            except ValueError:
                continue
            if isinstance(record, dict):
                yield journal, record


def _on_disk_as_recorded(path: Path, record: dict[str, Any]) -> bool:
    if not shard_written(record):
        return not path.exists()
    return path.is_file() and path.stat().st_size == record["bytes"]


def shard_written(record: dict[str, Any]) -> bool:
    """Whether a journal record's file was written (False: every utterance planned for the
    shard was dropped while writing, so no file has its name)."""
    return record["bytes"] > 0


def record_path(record: dict[str, Any]) -> str:
    return f"{record['group']}/{record['name']}" if record.get("group") else record["name"]


PARTIAL_STATE = "partial-{:05d}.json"


def save_partial(d_out: Path, ordinal: int, state: dict[str, Any]) -> None:
    """Record how far shard ``ordinal`` got (its bytes must be on disk already). Not synced:
    a state lost with the machine only means that the shard is written again from its start."""
    write_json_atomic(Path(d_out) / STATE_DIR / PARTIAL_STATE.format(ordinal), state, d_out, sync=False)


def partial_states(d_out: Path) -> dict[int, dict[str, Any]]:
    """The recorded states of unfinished shards by ordinal (unreadable ones left out)."""
    states = {}
    for path in (Path(d_out) / STATE_DIR).glob("partial-*.json"):
        try:
            states[int(path.stem.split("-")[1])] = read_json(path, "", kind=dict)
        except (InputError, ValueError):
            continue  # cut short by a lost machine, or no file of seqshard's: its shard starts over
    return states


def forget_partial(d_out: Path, ordinal: int) -> None:
    (Path(d_out) / STATE_DIR / PARTIAL_STATE.format(ordinal)).unlink(missing_ok=True)
