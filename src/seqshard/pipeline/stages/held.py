"""What a window holds, by where its samples came from: the part of a window stage's state that
restores the window without reading it again.

A window stage's state names the source's state where its window began, and a restore reads
the window again from there (every sample of a sort window of thousands, and of the shuffle
window under it: 300-400 ms at 12,000 utterances, issue 32). Where each sample of the window
can be read again by itself, the state also holds the window's outputs as the origins of their
samples (shard, position, byte offset in each field file), with the source's state where the
window ended: a restore then reads only the samples of the outputs it hands out, as it hands
them out (``WindowStage.replay``, set by the reader that built the pipeline).

:class:`Held` is that record: made once per window, shared by the states of all of its outputs,
JSON-safe as a compact text (``encode``; what a saved state holds, and what a copy or a pickle of
a state carries).
"""

from __future__ import annotations

import base64
import json
import zlib
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ...errors import SeqshardError
from .sample import Sample

ENCODING = 1


class Origin(NamedTuple):
    """Where a sample was read: its shard, its position there and the byte offset of its first
    member in each field file read (by field set)."""

    shard: int
    ordinal: int
    offsets: tuple[tuple[str, int], ...]


class Held:
    """The outputs of one arranged window from output ``first`` on (those before it were handed
    out when the record was saved): ``counts[i]`` source items in output ``first + i``, the
    origins of all of them in output order, and per item an optional number (``extra``: a sort
    window's lengths). ``total``: the items of the whole window; ``ended``: the source ended in
    this window."""

    def __init__(
        self,
        counts: Sequence[int],
        shards: Sequence[int],
        ordinals: Sequence[int],
        sets: tuple[str, ...],
        offsets: Sequence[Sequence[int]],
        extra: Sequence[int] | None,
        ended: bool,
        first: int = 0,
        total: int | None = None,
    ):
        self.counts = list(counts)
        self.shards, self.ordinals, self.sets, self.offsets = shards, ordinals, sets, offsets
        self.extra = extra
        self.ended = ended
        self.first = first
        self.starts = np.concatenate([[0], np.cumsum(self.counts, dtype=np.int64)]).tolist()
        self.total = self.starts[-1] if total is None else total
        self._text: str | None = None

    @property
    def items(self) -> int:
        """The items this record holds (of its outputs from ``first`` on)."""
        return self.starts[-1]

    @property
    def outputs(self) -> int:
        """The window's outputs, those before ``first`` included."""
        return self.first + len(self.counts)

    def trimmed(self, emitted: int) -> Held:
        """The record without the outputs before ``emitted`` (handed out: never read again)."""
        drop = emitted - self.first
        if drop <= 0:
            return self
        low = self.starts[min(drop, len(self.counts))]
        return Held(
            self.counts[drop:],
            self.shards[low:],
            self.ordinals[low:],
            self.sets,
            self.offsets[low:],
            None if self.extra is None else self.extra[low:],
            self.ended,
            self.first + min(drop, len(self.counts)),
            self.total,
        )

    @classmethod
    def describe(
        cls,
        outputs: Sequence[Any],
        items_of: Callable[[Any], list[Any]] | None,
        numbers_of: Callable[[Any], Sequence[int]] | None,
        ended: bool,
    ) -> Held | None:
        """The record of ``outputs`` (their source items by ``items_of``, None: each output is
        one; those items' numbers by ``numbers_of``, None: none), or None where the items are
        not samples read from shards. Made for every window, so kept to one pass over the
        items: the items of one window stage come from one reader, and read the same field
        sets (``replay.attach`` gives no window over a mix of sources a replay)."""
        held = [[output] for output in outputs] if items_of is None else [items_of(output) for output in outputs]
        samples = list(outputs) if items_of is None else [item for items in held for item in items]
        if samples and (type(samples[0]) is not Sample or not samples[0].offsets or samples[0].shard < 0):
            return None
        extra = None if numbers_of is None else [n for output in outputs for n in numbers_of(output)]
        try:
            places = [(s.shard, s.ordinal, s.offsets) for s in samples]
        except AttributeError:  # not a sample
            return None
        shards, ordinals, offsets = zip(*places) if places else ((), (), ())
        sets = tuple(name for name, _ in samples[0].offsets) if samples else ()
        return cls([len(items) for items in held], shards, ordinals, sets, offsets, extra, ended)

    def origins(self, output: int) -> list[Origin]:
        """The origins of output ``output``'s items (counted from the window's first output)."""
        output -= self.first
        return [
            Origin(int(self.shards[i]), int(self.ordinals[i]), self._places(i))
            for i in range(self.starts[output], self.starts[output + 1])
        ]

    def count_of(self, output: int) -> int:
        return self.counts[output - self.first]

    def _places(self, item: int) -> tuple[tuple[str, int], ...]:
        """Item ``item``'s (field set, offset) pairs (as a sample holds them, or decoded)."""
        found = self.offsets[item]
        if isinstance(found, tuple):
            return found
        return tuple(zip(self.sets, map(int, found)))

    def extra_of(self, output: int) -> list[int]:
        assert self.extra is not None
        output -= self.first
        return [int(x) for x in self.extra[self.starts[output] : self.starts[output + 1]]]

    # -- as text -------------------------------------------------------------------------------
    def encode(self) -> str:
        """The record as compact text (made once): the origins sorted by shard and position (their
        differences are small), with the order that gives them back in output order."""
        if self._text is None:
            offsets = self.offsets
            if len(offsets) and isinstance(offsets[0], tuple):  # as the samples held them: (field set, offset) pairs
                offsets = [[offset for _, offset in pairs] for pairs in offsets]
            shards, ordinals = np.asarray(self.shards, dtype=np.int64), np.asarray(self.ordinals, dtype=np.int64)
            order = np.lexsort((ordinals, shards))
            places = np.empty(len(order), dtype=np.int64)
            places[order] = np.arange(len(order))  # each item's place among the sorted ones
            columns = [
                np.asarray(self.counts, dtype=np.int64),
                shards[order],
                ordinals[order],
                np.asarray(offsets, dtype=np.int64).reshape(len(order), len(self.sets))[order].reshape(-1),
                np.asarray(self.extra if self.extra is not None else [], dtype=np.int64),
            ]
            body = b"".join(np.diff(c, prepend=0).astype("<i8").tobytes() for c in columns)  # differences pack well
            body += places.astype("<u2" if len(places) <= 1 << 16 else "<u4").tobytes()
            head = {
                "v": ENCODING,
                "sets": list(self.sets),
                "ended": self.ended,
                "extra": self.extra is not None,
                "first": self.first,
                "total": self.total,
                "sizes": [len(c) for c in columns],
            }
            self._text = json.dumps(head) + "\n" + base64.b64encode(zlib.compress(body, 6)).decode()
        return self._text

    @classmethod
    def decode(cls, text: str) -> Held:
        """The record ``encode`` gave (SeqshardError for anything else)."""
        try:
            head_text, body = text.split("\n", 1)
            head = json.loads(head_text)
            if head["v"] != ENCODING:
                raise ValueError(f"encoding {head['v']}")
            data = zlib.decompress(base64.b64decode(body))
            sizes = [int(size) for size in head["sizes"]]
            numbers = np.frombuffer(data, dtype="<i8", count=sum(sizes))
            columns, at = [], 0
            for size in sizes:
                columns.append(np.cumsum(numbers[at : at + size]))
                at += size
            counts, shards, ordinals, flat, extra = columns
            places = np.frombuffer(data, dtype="<u2" if len(shards) <= 1 << 16 else "<u4", offset=8 * at)
            if len(places) != len(shards) or (len(places) and places.max() >= len(shards)):
                raise ValueError("its order does not fit its origins")
            sets = tuple(head["sets"])
            offsets = flat.reshape(len(shards), len(sets))[places] if sets else np.zeros((len(shards), 0), np.int64)
            held = cls(
                counts.tolist(),
                shards[places],
                ordinals[places],
                sets,
                offsets,
                extra if head["extra"] else None,
                bool(head["ended"]),
                int(head["first"]),
                int(head["total"]),
            )
            if held.items != len(shards) or (held.extra is not None and len(held.extra) != len(shards)):
                raise ValueError("counts and origins disagree")
        except (ValueError, KeyError, TypeError, zlib.error) as error:
            raise SeqshardError(f"a saved window record cannot be read ({error}): the state is damaged.") from None
        held._text = text
        return held

    @classmethod
    def of(cls, value: Held | str) -> Held:
        """A record as a state holds it: the object itself, or its text (after a copy or a save)."""
        return value if isinstance(value, Held) else cls.decode(value)

    def __reduce__(self) -> tuple:
        return (Held.decode, (self.encode(),))

    def __deepcopy__(self, memo: dict) -> str:
        return self.encode()  # a copy of a state is its JSON-safe form (RankPosition.to_json)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (Held, str)):
            return self.encode() == (other.encode() if isinstance(other, Held) else other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]


def trimmed(state: Any) -> Any:
    """``state`` with each window's record without the outputs it had handed out (they are never
    read again), at any depth: what a saved state keeps (``RankPosition.to_json``)."""
    if isinstance(state, list):
        return [trimmed(item) for item in state]
    if not isinstance(state, dict):
        return state
    found = {key: trimmed(value) for key, value in state.items()}
    if "held" in found and "emitted" in found:
        found["held"] = Held.of(found["held"]).trimmed(int(found["emitted"]))
    return found


def without_held(state: Any) -> Any:
    """``state`` without what restores windows from their origins (``end``, ``held``) at any
    depth of its ``source``s: the state a window's start keeps, restored by reading again."""
    if not isinstance(state, dict):
        return state
    if "held" in state:
        return {k: v for k, v in state.items() if k not in ("end", "held")}  # its own start is plain already
    if "source" in state:
        return {**state, "source": without_held(state["source"])}
    return state
