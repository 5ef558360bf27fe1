"""One rank of a gloo job iterating a token loader (not a test module itself), started by
tests/test_token_blocks.py through tests/gloo_ranks.py like ddp_harness.py:

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/token_ddp_harness.py CONFIG.json

Writes the block ids of each step, the stats and a state saved after ``save_at`` steps (a
collective: every rank saves) to OUT/rank<r>.json.
"""

import datetime
import json
import sys
from pathlib import Path


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    import torch.distributed as dist

    import seqshard

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    loader = seqshard.make_token_loader(config["prefix"], **config["options"])
    if config.get("resume"):
        loader.load_state_dict(json.loads(Path(config["resume"]).read_text()), strict=False)
    steps, state = [], None
    for batch in loader:
        steps.append(batch["id"].tolist())
        if len(steps) == config.get("save_at"):
            state = loader.state_dict()
    record = {"rank": dist.get_rank(), "steps": steps, "state": state, "stats": loader.stats(), "len": len(loader)}
    (Path(config["out"]) / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
