"""Small dev/test sets that were never packed: random access over ``feats.scp`` (kaldiio).

With a dev set small enough for the page cache, random reads cost nothing, so the ordinary
map-style ``Dataset`` is the simplest right tool; batches come out as the streaming loader's.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .checks import MAX_WORKERS, check_flag, check_number
from .errors import SkipCounter
from .formats.kaldi import MatrixReader, parse_location
from .formats.keytable import KeyTable
from .pipeline.stages.batching import Batch
from .pipeline.stages.collate import Collator, speech_rules, to_tensors
from .pipeline.stages.labels import Labeler
from .pipeline.stages.sample import Sample
from .text.labels import LabelOverride
from .text.tokenizers import Tokenizer, make_tokenizer


class ScpDataset:
    """``dataset[i]`` is the i-th utterance of the scp file(s), with its label from ``text``
    (tokenized when a tokenizer is given). A torch map-style dataset (``__len__``/``__getitem__``)."""

    def __init__(
        self,
        feats_scp: str | Path | Sequence[str | Path],
        text: str | Path | Sequence[str | Path] | None = None,
        tokenizer: str | Path | Tokenizer | None = None,
        *,
        split: str | None = None,
        strip_spaces: bool = False,
        path_root: str | Path | None = None,
        path_map: Sequence[tuple[str, str]] = (),
    ):
        check_flag("strip_spaces", strip_spaces)
        files = [Path(feats_scp)] if isinstance(feats_scp, (str, Path)) else [Path(f) for f in feats_scp]
        self.scp = KeyTable.scan(files, SkipCounter(False))
        self.labeler = Labeler(
            make_tokenizer(tokenizer, split), LabelOverride(text) if text is not None else None, strip_spaces
        )
        self.path_root = Path(path_root) if path_root else None
        self.path_map = tuple(path_map)
        self._reader: MatrixReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_reader": None}  # each worker opens its own arks

    def __len__(self) -> int:
        return len(self.scp)

    def __getitem__(self, index: int) -> Sample:
        if self._reader is None:
            self._reader = MatrixReader()
        key, value = self.scp.record(index)
        where = self.scp.where(index, key)
        feats = self._reader.read(parse_location(value, where, self.path_map, self.path_root), where)
        return self.labeler(Sample(key, {"feats": feats}, ordinal=index))


def collate(samples: Sequence[Sample], pad_label: int = -1, dtype: str = "float32") -> dict[str, Any]:
    """Samples as a batch of torch tensors, with ``make_loader``'s batch keys."""
    collator = Collator(speech_rules("feats", pad_label, dtype))
    return to_tensors(collator(Batch(list(samples), [len(s["feats"]) for s in samples])))


def make_scp_loader(
    feats_scp,
    text=None,
    tokenizer=None,
    *,
    batch_size: int = 16,
    num_workers: int = 0,
    pad_label: int = -1,
    **dataset_options: Any,
):
    """A torch DataLoader over :class:`ScpDataset` in file order, batches as ``make_loader``'s."""
    import torch.utils.data

    check_number("batch_size", batch_size, whole=True, at_least=1)
    check_number("num_workers", num_workers, whole=True, at_least=0, at_most=MAX_WORKERS)
    check_number("pad_label", pad_label, whole=True)

    dataset = ScpDataset(feats_scp, text, tokenizer, **dataset_options)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=partial(collate, pad_label=pad_label),
    )
