"""Makes this folder: shards packed by seqshard at acb907c (state version 2, before sort and
shuffle windows grew), the loader state that version saved after 7 batches, and the keys of
the batches it gave after that state (tests/test_feed.py resumes the state with today's code).

    PYTHONPATH=<a checkout of acb907c>:tests python tests/data/state-v2/make.py "seqshard at acb907c (...)"
"""

import json
import shutil
import sys
import tempfile
from pathlib import Path

from conftest import write_kaldi_dir
from seqshard import make_loader, pack_data

HERE = Path(__file__).parent
OPTIONS = dict(batch_size=4, sort_window=70, shuffle_window=70, num_workers=0, seed=3)
SAVED_AFTER = 7

with tempfile.TemporaryDirectory() as folder:
    data = write_kaldi_dir(Path(folder), speakers=10, per_speaker=15, dim=2, frames=(2, 9), seed=7)
    shutil.rmtree(HERE / "shards", ignore_errors=True)
    pack_data(data.scp, data.text, HERE / "shards", utts_per_file=75, progress=False)
shutil.rmtree(HERE / "shards" / ".seqshard-pack", ignore_errors=True)
(HERE / "shards" / "pack_report.json").unlink()
pattern = str(HERE / "shards" / "data-*.tar")
loader = make_loader(pattern, **OPTIONS)
batches = iter(loader)
head = [next(batches)["keys"] for _ in range(SAVED_AFTER)]
state = loader.state_dict()
rest = [batch["keys"] for batch in batches]
(HERE / "state.json").write_text(json.dumps(state, indent=1) + "\n")
(HERE / "expected.json").write_text(
    json.dumps(
        {"options": OPTIONS, "head": head, "rest": rest, "made_by": sys.argv[1] if len(sys.argv) > 1 else ""}, indent=1
    )
    + "\n"
)
print(len(head), "+", len(rest), "batches")
