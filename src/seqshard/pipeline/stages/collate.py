"""Collating a batch field by field, in the worker process, as numpy arrays.

Arrays are padded on their first axis into ``NAME`` (B x T x ...) plus ``NAME_lens``; numbers
are stacked into ``NAME`` (B); texts, bytes and other values are kept as lists. Rules rename
fields and set padding and dtype: feature shards keep their batch keys (``feats``,
``feat_lens``, ``labels``, ``label_lens``, ``texts``) and ``keys`` lists the samples' keys. A
sample without a field another sample has gets length -1 (padded arrays) or None (lists); a
field the loader was asked for is in every batch, also where no sample has it (``add-field
--allow-missing``): lengths all -1 and an empty array (B x 0 x ..., of the dtype and shape
the field's index records, else as the field was last seen), or a list of None.

The arrays are allocated by the caller's ``allocate(shape, dtype)`` (numpy, or views of a
shared-memory slot: see ``pipeline/transport/slots.py``); only the batch crosses to the training process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np

from ...errors import InputError
from .batching import Batch
from .sample import Sample

Allocate = Callable[[tuple[int, ...], np.dtype], np.ndarray]
Layout = tuple[str, tuple[int, ...]]  # an array field's dtype and shape after its first axis
ABSENT_LENGTH = -1


@dataclass(frozen=True)
class FieldRule:
    """Field ``field`` goes into batch key ``out``; padded arrays also give ``lengths``
    (default ``out + "_lens"``), padded with ``pad`` and cast to ``dtype`` (when given)."""

    field: str
    out: str
    lengths: str | None = None
    pad: float = 0
    dtype: str | None = None


def speech_rules(feature_field: str, pad_label: int, dtype: str) -> tuple[FieldRule, ...]:
    """The batch keys of feature shards: ``feats``/``feat_lens``, ``labels``/``label_lens``, ``texts``."""
    return (
        FieldRule(feature_field, "feats", "feat_lens", 0, dtype),
        FieldRule("tokens", "labels", "label_lens", pad_label, "int64"),
        FieldRule("txt", "texts"),
    )


@dataclass
class _Column:
    """One field of a batch, laid out: how it is collated and what it allocates."""

    rule: FieldRule
    kind: str  # "padded", "stacked" or "list"
    values: list[Any]
    shape: tuple[int, ...] = ()
    dtype: np.dtype | None = None


class Collator:
    """Collates batches of samples by ``rules`` (other fields get default rules); ``expected``
    fields (name -> ``"padded"`` or ``"list"``, and an array field's dtype and shape after its
    first axis when known) are in every batch."""

    def __init__(self, rules: Sequence[FieldRule] = (), expected: dict[str, tuple[str, Layout | None]] | None = None):
        self.rules = {rule.field: rule for rule in rules}
        self.expected = dict(expected or {})
        self._seen: dict[str, Layout] = {}  # a padded field's dtype and shape after its first axis, as last seen

    def layout(self, batch: Batch) -> list[_Column]:
        """How each field of ``batch`` is collated, and the arrays it needs."""
        samples = batch.samples
        names = dict.fromkeys(chain.from_iterable([sample.fields for sample in samples]))
        columns = []
        for name in names:
            rule = self.rules.get(name) or FieldRule(name, name)
            values = [sample.fields.get(name) for sample in samples]
            present = values[0] if values[0] is not None else next(v for v in values if v is not None)
            if isinstance(present, np.ndarray) and present.ndim >= 1:
                column = _padded(rule, values, samples)
                self._seen[name] = (column.dtype.str, column.shape[2:])  # type: ignore[union-attr]
                columns.append(column)
            elif isinstance(present, (bool, int, float, np.generic, np.ndarray)) and None not in values:
                dtype = np.dtype(rule.dtype) if rule.dtype else np.asarray(values).dtype
                columns.append(_Column(rule, "stacked", values, (len(values),), dtype))
            else:
                columns.append(_Column(rule, "list", values))
        for name, (kind, layout) in self.expected.items():
            if name not in names:
                columns.append(self._absent(name, kind, layout, len(samples)))
        return columns

    def _absent(self, name: str, kind: str, layout: Layout | None, count: int) -> _Column:
        """The column of a field no sample of the batch has."""
        rule = self.rules.get(name) or FieldRule(name, name)
        if kind != "padded":
            return _Column(rule, "list", [None] * count)
        dtype, trailing = layout or self._seen.get(name, ("float32", ()))
        return _Column(rule, "padded", [None] * count, (count, 0, *trailing), np.dtype(rule.dtype or dtype))

    def __call__(self, batch: Batch, allocate: Allocate | None = None) -> dict[str, Any]:
        """The batch as numpy arrays and lists (arrays from ``allocate``, default numpy)."""
        return self.fill(batch, self.layout(batch), allocate)

    def fill(self, batch: Batch, columns: list[_Column], allocate: Allocate | None = None) -> dict[str, Any]:
        """The batch collated along ``columns`` (from :meth:`layout`)."""
        allocate = allocate or (lambda shape, dtype: np.empty(shape, dtype))
        out: dict[str, Any] = {"keys": [sample.key for sample in batch.samples]}
        for column in columns:
            rule = column.rule
            if column.kind == "padded":
                array = allocate(column.shape, column.dtype)  # type: ignore[arg-type]
                lengths = allocate((len(column.values),), np.dtype(np.int64))
                _pad_into(array, lengths, column.values, rule.pad)
                out[rule.out] = array
                out[rule.lengths or f"{rule.out}_lens"] = lengths
            elif column.kind == "stacked":
                array = allocate(column.shape, column.dtype)  # type: ignore[arg-type]
                array[:] = column.values
                out[rule.out] = array
            else:
                out[rule.out] = [bytes(v) if isinstance(v, memoryview) else v for v in column.values]
        return out


def array_bytes(columns: list[_Column], align: int) -> int:
    """Bytes of the arrays collating ``columns`` allocates, each rounded up to ``align``."""
    total = 0
    for column in columns:
        if column.kind != "list":
            total += aligned(int(np.prod(column.shape)) * column.dtype.itemsize, align)  # type: ignore[union-attr]
        if column.kind == "padded":
            total += aligned(8 * len(column.values), align)
    return total


def aligned(size: int, align: int) -> int:
    return -(-size // align) * align


def _padded(rule: FieldRule, values: list[Any], samples: Sequence[Sample]) -> _Column:
    present = [v for v in values if v is not None]
    trailing = present[0].shape[1:]
    for sample, value in zip(samples, values):
        if value is not None and value.shape[1:] != trailing:
            raise InputError(
                sample.where(),
                "shape_mismatch",
                f"field {rule.field!r} is {value.shape} where other samples of the batch have {('T', *trailing)}.",
                "pack or select samples of one kind together.",
            )
    dtype = np.dtype(rule.dtype) if rule.dtype else present[0].dtype
    longest = max(map(len, present))
    return _Column(rule, "padded", values, (len(values), longest, *trailing), dtype)


def _pad_into(out: np.ndarray, lengths: np.ndarray, values: list[Any], pad: float) -> None:
    """Write ``values`` into ``out`` (B x T x ...) padded with ``pad``; ``out`` may hold old data."""
    for row, value in enumerate(values):
        if value is None:
            lengths[row] = ABSENT_LENGTH
            out[row] = pad
            continue
        length = len(value)
        lengths[row] = length
        out[row, :length] = value
        out[row, length:] = pad


def to_tensors(arrays: dict[str, Any]) -> dict[str, Any]:
    """The same batch with numpy arrays as torch tensors (sharing their memory)."""
    import torch

    return {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in arrays.items()}
