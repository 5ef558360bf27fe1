"""Labels given at load time: Kaldi ``text`` files whose labels replace the shards' by key
(relabel without repacking), looked up without a Python object per key."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from ..errors import ConfigError, InputError, SkipCounter
from ..formats.peers.keytable import KeyTable


class LabelOverride:
    """Labels from Kaldi ``text`` files, looked up by key (compact: no per-key Python objects)."""

    def __init__(self, files: str | Path | Sequence[str | Path]):
        listed = list(files) if isinstance(files, (list, tuple)) else [files]
        if not all(isinstance(f, (str, os.PathLike)) for f in listed):
            raise ConfigError(f"labels must be a Kaldi text file or a list of them, got {files!r}.")
        paths = [Path(f) for f in listed]
        for path in paths:
            if path.is_dir():
                raise ConfigError(f"label file {str(path)!r} is a folder; give Kaldi text file(s).")
            if not path.is_file():
                raise ConfigError(f"label file {str(path)!r} does not exist.")
        try:
            self.table = KeyTable.scan(paths, SkipCounter(False), needs_value=False)
            self.table.report_repeats(
                SkipCounter(False),
                "duplicate_label",
                "the key already has a label at {first}.",
                "remove duplicate lines.",
            )
        except InputError as error:
            error.skippable = False  # the label files are settings: fix them, nothing is skipped
            raise

    def get(self, key: str) -> str | None:
        found = self.table.find(key)
        return None if found is None else found[1]
