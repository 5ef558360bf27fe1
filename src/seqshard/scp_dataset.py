"""Small dev/test sets that were never packed: random access over ``feats.scp`` (kaldiio).

With a dev set small enough for the page cache, random reads cost nothing, so the ordinary
map-style ``Dataset`` is the simplest right tool; batches come out as the streaming loader's.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import Any

from .checks import check_flag, check_rule
from .dist import discover
from .errors import InputError, SeqshardError, SkipCounter, StateMismatchError
from .formats.peers.kaldi import MatrixReader, parse_location
from .formats.peers.keytable import KeyTable
from .pipeline.stages.batching import Batch
from .pipeline.stages.collate import Collator, speech_rules, to_tensors
from .pipeline.stages.labels import Labeler
from .pipeline.stages.sample import Sample
from .protocol import PlannedBatches
from .text.label_override import LabelOverride
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

    for name, value in (("batch_size", batch_size), ("num_workers", num_workers), ("pad_label", pad_label)):
        check_rule(name, value)

    dataset = ScpDataset(feats_scp, text, tokenizer, **dataset_options)
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=partial(collate, pad_label=pad_label),
    )


class MapStyleLoader:
    """The ordinary loader over an :class:`ScpDataset` (``large_dataset: false``, and Kaldi dev
    sets), in the :class:`seqshard.protocol.Loader` shape: shuffled per epoch (or in file order),
    split over ranks by torch's DistributedSampler (which repeats a few utterances so every rank
    has as many), batches of ``batch_size`` in make_loader's format. An error in a worker is
    raised with its own type (as make_loader's are), not as torch's RuntimeError. Its state is
    the epoch and the batches taken: a resume goes on at the next batch."""

    def __init__(
        self,
        dataset: ScpDataset,
        *,
        batch_size: int,
        shuffle: bool,
        num_workers: int,
        rank: int | None,
        world_size: int | None,
        seed: int = 0,
    ):
        import torch.utils.data

        context = discover(rank, world_size)
        self.dataset = dataset
        self.tokenizer = dataset.labeler.tokenizer
        self.batch_size = check_rule("batch_size", batch_size)
        self.num_workers = check_rule("num_workers", num_workers)
        self.sampler = torch.utils.data.DistributedSampler(
            dataset, context.world_size, context.rank, shuffle=check_flag("shuffle", shuffle), seed=seed
        )
        self._epoch = 0
        self._chosen = False  # set_epoch was called since the last iteration began
        self._step = 0  # batches taken in the current epoch
        self._completed = False  # the current epoch ran to its end
        self._utts = 0
        self._active: Any = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def dim(self) -> int:
        return int(self.dataset[0]["feats"].shape[1])

    def set_epoch(self, epoch: int) -> None:
        self._epoch, self._chosen = epoch, True

    def planned_batches(self) -> PlannedBatches:
        total = math.ceil(len(self.sampler) / self.batch_size)
        fresh = self._completed or self._chosen  # the next iteration starts an epoch
        return PlannedBatches(total, total if fresh else total - self._step)

    def __len__(self) -> int:
        return self.planned_batches().total

    def planned_utts(self) -> int:
        """Utterances this rank reads in an epoch."""
        return len(self.sampler)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        import torch.utils.data

        if self._completed and not self._chosen:
            self._epoch += 1  # iterating again after a finished epoch runs the next one
        if self._completed or self._chosen:
            self._step = 0
        self._chosen, self._completed, self._utts = False, False, 0
        self.sampler.set_epoch(self._epoch)
        indices = list(self.sampler)[self._step * self.batch_size :]
        loader = torch.utils.data.DataLoader(
            _ErrorsAsItems(self.dataset),
            batch_size=self.batch_size,
            sampler=indices,
            num_workers=self.num_workers,
            collate_fn=_collate_or_error,
        )
        self._active = iter(loader)
        for batch in self._active:
            if isinstance(batch, SeqshardError):
                raise batch
            self._step += 1
            self._utts += len(batch["keys"])
            yield batch
        self._completed, self._active = True, None

    def stats(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "steps": self._step, "utts": self._utts}

    def state_dict(self) -> dict[str, Any]:
        return {"seqshard_map_style_state": 1, "epoch": self._epoch, "step": self._step, "completed": self._completed}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Go on at the batch after the saved one (the next epoch when the saved one had ended)."""
        if state.get("seqshard_map_style_state") != 1:
            raise StateMismatchError("not a map-style loader state of this version (seqshard_map_style_state).")
        self._epoch, self._step, self._completed = int(state["epoch"]), int(state["step"]), bool(state["completed"])
        self._chosen = False

    def close(self) -> None:
        """Stop worker processes (an iteration after this starts them again)."""
        self._active = None


class _ErrorsAsItems:
    """A map-style dataset whose seqshard errors are items, so that they leave a DataLoader
    worker as they are (torch turns an exception it cannot rebuild into a RuntimeError);
    bad input is never skipped here, so no message offers skip_bad."""

    def __init__(self, dataset: Any):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except SeqshardError as error:
            if isinstance(error, InputError):
                error.skippable = False
            return error


def _collate_or_error(samples: list[Any]) -> Any:
    """A batch of samples as make_loader's, or the first error among them."""
    return next((s for s in samples if isinstance(s, SeqshardError)), None) or collate(samples)
