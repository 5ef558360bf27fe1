"""The pack journal: which shards are finished, kept in ``OUT/.seqshard-pack/``.

Each writer process appends one JSON line per shard after the shard has been renamed to its
final name. A rerun of the same command trusts a shard only when it has both its file (of the
recorded size) and its journal line, and writes every other shard again. A shard whose planned
utterances were all dropped while writing is journaled with 0 bytes and has no file (an empty
shard is never given its final name): it is finished when no file has its name.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..formats.files import writing
from ..formats.pack_state import STATE_DIR


class Journal:
    """Append-only journal file of one writer process (``kind``: ``journal`` for the pack's
    shards, ``field-NAME`` for the sidecar files of field set NAME)."""

    def __init__(self, d_out: Path, name: str, kind: str = "journal"):
        folder = Path(d_out) / STATE_DIR
        self.path = folder / f"{kind}-{name}.jsonl"
        with writing(folder):
            folder.mkdir(parents=True, exist_ok=True)

    def append(self, record: dict[str, Any]) -> None:
        with writing(self.path), open(self.path, "a", encoding="utf-8") as stream:
            stream.write(json.dumps(record, ensure_ascii=False) + "\n")
            stream.flush()
            os.fsync(stream.fileno())


def finished_shards(d_out: Path, kind: str = "journal") -> dict[str, dict[str, Any]]:
    """Records of shards (or sidecar files) that are complete on disk, keyed by path relative
    to ``d_out``."""
    records: dict[str, dict[str, Any]] = {}
    for journal in sorted((Path(d_out) / STATE_DIR).glob(f"{kind}-*.jsonl")):
        with open(journal, encoding="utf-8") as stream:
            for line in stream:
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by a crash: its shard is redone
                relative = record_path(record)
                path = Path(d_out) / relative
                if _on_disk_as_recorded(path, record):
                    records[relative] = record
    return records


def _on_disk_as_recorded(path: Path, record: dict[str, Any]) -> bool:
    if not shard_written(record):
        return not path.exists()
    return path.is_file() and path.stat().st_size == record["bytes"]


def shard_written(record: dict[str, Any]) -> bool:
    """Whether a journal record's file was written (False: every utterance planned for the
    shard was dropped while writing, so no file has its name)."""
    return record["bytes"] > 0


def record_path(record: dict[str, Any]) -> str:
    return f"{record['group']}/{record['name']}" if record["group"] else record["name"]
