"""The label stage: labels from an override file (``text/label_override.py``) and tokens from a
tokenizer (``text/tokenizers.py``), on the fly: changing the tokenizer never needs a repack."""

from __future__ import annotations

import numpy as np

from ...errors import InputError, SkipCounter, Where
from ...text.label_override import LabelOverride
from ...text.tokenizers import Tokenizer
from .base import Map, Stage
from .decode import LABEL_FIELD
from .filters import TOKENS_FIELD
from .sample import Sample


class Labeler:
    """Sample -> Sample with its label (field ``txt``, as stored, or from the override file if
    any) and its tokens (field ``tokens``, an int64 array; if a tokenizer) of the label with
    the whitespace around it stripped (with ``strip_spaces``, every space); a key missing from
    the override raises InputError (reason ``no_label``)."""

    def __init__(self, tokenizer: Tokenizer | None, override: LabelOverride | None = None, strip_spaces: bool = False):
        self.tokenizer = tokenizer
        self.override = override
        self.strip_spaces = strip_spaces

    def __call__(self, sample: Sample) -> Sample:
        text = sample.fields.get(LABEL_FIELD, "")
        if self.override is not None:
            label = self.override.get(sample.key)
            if label is None:
                raise InputError(
                    Where(", ".join(map(str, self.override.table.files)), None, sample.key),
                    "no_label",
                    "the label file given at load time has no line for this key.",
                    "add it.",
                )
            text = label
        sample.fields[LABEL_FIELD] = text
        if self.tokenizer is not None:
            spoken = "".join(text.split()) if self.strip_spaces else text.strip()
            sample.fields[TOKENS_FIELD] = np.asarray(self.tokenizer.encode(spoken), dtype=np.int64)
        return sample


class Labels(Map[Sample]):
    """Applies a :class:`Labeler`, counting label tokens and unknown tokens (``tokens``,
    ``unknown_tokens`` in stats); with ``skip`` a sample whose label is missing is counted
    under ``dropped.no_label`` instead of raising."""

    def __init__(self, source: Stage[Sample], labeler: Labeler, skip: SkipCounter | None = None):
        super().__init__(source, labeler, skip)
        self.unk_id = labeler.tokenizer.unk_id if labeler.tokenizer is not None else None

    def next(self) -> Sample:
        sample = super().next()
        tokens = sample.fields.get(TOKENS_FIELD)
        if tokens is not None:
            self.count("tokens", len(tokens))
            self.count("unknown_tokens", int(np.count_nonzero(tokens == self.unk_id)))
        return sample
