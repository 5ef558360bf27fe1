"""Other tools doing the same job, run as separate processes by the benchmarks.

python bench/baselines.py wds-pack SCP TEXT OUT        WebDataset ShardWriter fed by kaldiio
python bench/baselines.py copy OUT ARK...              raw sequential copy of the ark bytes
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import fsync_tree


def wds_pack(scp: str, text: str, out: str) -> None:
    import kaldiio
    import webdataset as wds

    with open(text, encoding="utf-8") as lines:
        labels = dict(line.rstrip("\n").split(" ", 1) for line in lines)
    Path(out).mkdir(parents=True, exist_ok=True)
    with wds.ShardWriter(f"{out}/wds-%05d.tar", maxcount=2000, verbose=0) as sink:
        for key, array in kaldiio.load_scp_sequential(scp):
            sink.write({"__key__": key, "feats.npy": array, "txt": labels[key]})
    fsync_tree(Path(out))


def copy(out: str, arks: list[str]) -> None:
    """``cp`` then ``sync``: every byte read once and written once, then all flushed at once
    (a whole-system sync lets the disk queue every write; fsync file by file was slower here)."""
    Path(out).mkdir(parents=True, exist_ok=True)
    for ark in arks:
        with open(ark, "rb") as source, open(Path(out) / Path(ark).name, "wb") as sink:
            shutil.copyfileobj(source, sink, 8 << 20)
    os.sync()


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    if command == "wds-pack":
        wds_pack(*args)
    elif command == "copy":
        copy(args[0], args[1:])
    else:
        raise SystemExit(__doc__)
