"""The whole `pack` process's peak memory per utterance, planning and writing together.

    python bench/pack_memory.py [--sizes 250000 1000000] [--work bench/out] [--quick]

Makes (once per size) a Kaldi data dir of N utterances: one ark of N one-frame matrices
(so the run is bound by metadata, not by feature bytes), a ``feats.scp`` naming them by
absolute path and offset, and a ``text`` of short transcripts, with keys shaped like
Kaldi's (``spk000012-utt00000480``). Each size is packed by ``seqshard pack`` in a fresh
process under ``bench/peak.py``, which reads the process's own ``VmHWM`` at exit; the baseline
is the same interpreter importing the same modules and packing nothing. Printed: peak RSS
per size, the baseline, bytes per utterance over the baseline at each size, and between the
two sizes. Writes WORK/pack_memory.json.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import run_measured, with_quick

HERE = Path(__file__).parent
DIM = 4
BASELINE = "import seqshard.cli, seqshard.prep.pack, seqshard.prep.write, numpy"


def make_data(folder: Path, count: int) -> tuple[Path, Path]:
    """A feats.scp + text of ``count`` one-frame float32 matrices in one binary ark."""
    scp, text = folder / "feats.scp", folder / "text"
    if scp.exists() and text.exists():
        return scp, text
    folder.mkdir(parents=True, exist_ok=True)
    ark = folder / "feats.ark"
    matrix = b"\0BFM " + b"\x04" + struct.pack("<i", 1) + b"\x04" + struct.pack("<i", DIM) + bytes(4 * DIM)
    with open(ark, "wb") as arks, open(scp, "w") as scps, open(text, "w") as texts:
        offset = 0
        for i in range(count):
            key = f"spk{i // 40:06d}-utt{i:08d}"
            head = f"{key} ".encode()
            arks.write(head + matrix)
            scps.write(f"{key} {ark.resolve()}:{offset + len(head)}\n")
            texts.write(f"{key} SOME WORDS OF A TRANSCRIPT NUMBER {i % 977}\n")
            offset += len(head) + len(matrix)
    return scp, text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs=2, default=(250_000, 1_000_000), help="utterances packed")
    parser.add_argument("--work", type=Path, default=HERE / "out")
    args = with_quick(parser, sizes=(20_000, 80_000), work=HERE / "out" / "quick")
    folder = args.work / "pack_memory"
    _, baseline = run_measured(["-c", BASELINE])
    results: dict = {"baseline_mb": round(baseline, 1), "sizes": {}}
    print(f"baseline (interpreter + imports): {baseline:.0f} MB")
    for count in args.sizes:
        scp, text = make_data(folder / str(count), count)
        out = folder / f"out-{count}"
        shutil.rmtree(out, ignore_errors=True)
        seconds, peak = run_measured(
            ["-m", "seqshard", "pack", "--scp", str(scp), "--text", str(text), "--out", str(out), "--quiet"]
        )
        per_utt = (peak - baseline) * 2**20 / count
        results["sizes"][count] = {
            "peak_mb": round(peak, 1),
            "seconds": round(seconds, 1),
            "bytes_per_utt": round(per_utt),
        }
        print(
            f"{count:>9} utterances: peak RSS {peak:6.0f} MB in {seconds:5.1f} s: {per_utt:4.0f} B/utt over the baseline"
        )
        shutil.rmtree(out, ignore_errors=True)
    small, large = (results["sizes"][n] for n in args.sizes)
    slope = (large["peak_mb"] - small["peak_mb"]) * 2**20 / (args.sizes[1] - args.sizes[0])
    results["bytes_per_utt_between_sizes"] = round(slope)
    print(f"between the sizes: {slope:.0f} B/utt")
    (args.work / "pack_memory.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
