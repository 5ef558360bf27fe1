"""A pack's line tables cut into chunks of whole lines: the unit of the scan wave.

A chunk is a byte range of one table file that starts at a line and ends after one, with the
number of its first line, so that every error a scan task raises names the file and line. The
cut is a pure function of the files' bytes and :data:`CHUNK_BYTES`: whatever runs the pack
(one process, a pool, a cluster, parts of an array job), the same chunks are scanned.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

CHUNK_BYTES = 32 << 20  # of table lines a scan task reads (~350,000 lines of a feats.scp)
_BLOCK = 8 << 20


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, end)`` of file ``file`` of table ``table``: ``lines`` lines, the first
    numbered ``first_line`` (1-based) in the file. ``number`` orders every chunk of a pack: input
    order."""

    number: int
    table: str
    file: int
    start: int
    end: int
    first_line: int
    lines: int


def line_chunks(
    table: str,
    files: Sequence[Path],
    first_number: int = 0,
    size: int = CHUNK_BYTES,
    progress: Callable[[int], None] | None = None,
) -> list[Chunk]:
    """The chunks of ``files`` (one table), about ``size`` bytes each, numbered from
    ``first_number``: each file is read once, its lines counted (no line is held)."""
    chunks: list[Chunk] = []
    for file_index, path in enumerate(files):
        for start, end, first_line, lines in _cuts(Path(path), size, progress):
            chunks.append(Chunk(first_number + len(chunks), table, file_index, start, end, first_line, lines))
    return chunks


def _cuts(path: Path, size: int, progress: Callable[[int], None] | None) -> Iterator[tuple[int, int, int, int]]:
    """``(start, end, first line, lines)`` of each chunk of one file (none for an empty file)."""
    start, lines_before, position, lines, last = 0, 0, 0, 0, b"\n"
    with open(path, "rb", buffering=0) as stream:
        while block := stream.read(_BLOCK):
            if progress is not None:
                progress(len(block))
            cut_from = 0
            while position + len(block) - start >= size:  # this block holds the next cut
                wanted = max(start + size - position, cut_from)
                newline = block.find(b"\n", wanted)
                if newline < 0:
                    break
                end = position + newline + 1
                chunk_lines = lines + block.count(b"\n", cut_from, newline + 1)
                yield start, end, lines_before + 1, chunk_lines
                lines_before += chunk_lines
                start, lines, cut_from = end, 0, newline + 1
            lines += block.count(b"\n", cut_from)
            position += len(block)
            last = block[-1:]
    if position > start:
        yield start, position, lines_before + 1, lines + (last != b"\n")
