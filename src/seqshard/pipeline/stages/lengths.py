"""How long a sample is: a measure that names its field and unit.

Batching (sorting, padded cost), length filters, bucket sync and the index's length
histograms all go through one measure, so that "1000" means the same thing everywhere:
frames of a feature field, samples of an audio field, or tokens of token fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ...errors import InputError
from ...features.fbank import FbankOptions, num_frames
from .sample import Sample


@dataclass(frozen=True)
class Length:
    """Length of field ``field`` in ``unit``: the size of its first axis (frames of a T x D
    array, tokens of a token sequence); with no field every sample counts 1."""

    field: str | None = "feats"
    unit: str = "frames"

    def __call__(self, sample: Sample) -> int:
        if self.field is None:
            return 1
        try:
            return len(sample.fields[self.field])
        except KeyError:
            raise InputError(
                sample.where(),
                "missing_field",
                f"the sample has no {self.field!r} field to measure its length in {self.unit} "
                f"(it has: {', '.join(sorted(sample.fields)) or 'nothing'}).",
                "choose the fields= that hold it, or batch by batch_size.",
            ) from None

    def describe(self) -> str:
        return f"{self.unit} of {self.field!r}"


@dataclass(frozen=True)
class TotalLength:
    """Summed length of several fields (source + target tokens)."""

    fields: Sequence[str]
    unit: str = "tokens"

    def __call__(self, sample: Sample) -> int:
        return sum(Length(name, self.unit)(sample) for name in self.fields)

    def describe(self) -> str:
        return f"{self.unit} of {' + '.join(map(repr, self.fields))}"


@dataclass(frozen=True)
class Duration:
    """Length of an audio field in frames of ``shift_ms`` (10 ms: the frames fbank will make,
    and the unit of an audio shard's index), from its samples and ``sample_rate``."""

    field: str = "audio"
    shift_ms: float = 10.0
    unit: str = "frames"

    def __call__(self, sample: Sample) -> int:
        samples = Length(self.field, "samples")(sample)
        return round(samples * 1000 / (sample.fields["sample_rate"] * self.shift_ms))

    def describe(self) -> str:
        return f"{self.shift_ms:g} ms frames of {self.field!r}"


@dataclass(frozen=True)
class FbankFrames:
    """Length of an audio field in the frames fbank with ``options`` makes of it: the length
    of the features when they are made after the workers (``feature_device``), so that the
    batches are those of fbank in the workers."""

    options: FbankOptions
    field: str = "audio"
    unit: str = "frames"

    def __call__(self, sample: Sample) -> int:
        return num_frames(Length(self.field, "samples")(sample), self.options)

    def describe(self) -> str:
        return f"fbank frames of {self.field!r}"


Measure = Length | TotalLength | Duration | FbankFrames
