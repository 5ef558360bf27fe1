"""One rank of a gloo job, started by the distributed tests (not a test module itself).

    RANK=r WORLD_SIZE=n MASTER_ADDR=127.0.0.1 MASTER_PORT=p python tests/ddp_harness.py CONFIG.json

Trains nothing but iterates the loader like a training loop would (``mode="join"`` runs a
tiny DDP model under torch's Join) and writes what each step received, and the collectives
each epoch made, to OUT/rank<r>.json.
"""

import datetime
import faulthandler
import json
import os
import sys
import time
from pathlib import Path


def main() -> None:
    config = json.loads(Path(sys.argv[1]).read_text())
    faulthandler.dump_traceback_later(100)  # a job that hangs says where (the test gives up at 120 s)
    import torch
    import torch.distributed as dist

    import seqshard
    from seqshard.testing import collectives_made

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=config.get("collective_timeout", 60)))
    rank = dist.get_rank()
    out = Path(config["out"])
    pattern = config.get("pattern_of_rank", {}).get(str(rank), config["pattern"])
    if isinstance(pattern, dict):  # {"mux": [patterns], "weights": [...]}: mixed sources
        pattern = seqshard.mux(pattern["mux"], weights=pattern.get("weights"), temperature=pattern.get("temperature"))
    loader = seqshard.make_loader(pattern, **config["options"])
    if config.get("resume"):
        loader.load_state_dict(json.loads(Path(config["resume"]).read_text()), strict=not config.get("elastic", False))
    model = None
    if config.get("join"):
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(config["dim"], 1))
    record = {"rank": rank, "epochs": []}
    for epoch in config["epochs"]:
        loader.set_epoch(epoch)
        steps = []
        started = time.perf_counter()
        collectives = collectives_made(loader)
        if model is not None:
            from torch.distributed.algorithms.join import Join

            with Join([model]):
                for batch in loader:
                    model(batch["feats"].mean(dim=1)).sum().backward()
                    steps.append({"keys": batch["keys"], "frames": int(batch["feats"].shape[1])})
        else:
            for batch in loader:
                steps.append(
                    {
                        "keys": batch["keys"],
                        "frames": int(batch["feats"].shape[1]),
                        "length": int(batch["feat_lens"].sum()),
                    }
                )
                if config.get("save_at") == [epoch, len(steps)]:
                    state = loader.state_dict()  # a collective: every rank calls it
                    (out / f"before-rank{rank}.json").write_text(
                        json.dumps(record["epochs"] + [{"epoch": epoch, "steps": steps}])
                    )
                    if rank == 0:
                        (out / "state.json.partial").write_text(json.dumps(state))
                        os.replace(out / "state.json.partial", out / "state.json")
                time.sleep(config.get("sleep", 0))
        record["epochs"].append(
            {
                "epoch": epoch,
                "steps": steps,
                "summary": loader.last_summary,
                "stats": loader.stats(),
                "seconds": time.perf_counter() - started,
                "collectives": collectives_made(loader) - collectives,
            }
        )
    if config.get("measure_collective"):
        calls = 2000
        started = time.perf_counter()
        for _ in range(calls):
            loader.collectives.all_min([1])
        record["collective_ms"] = (time.perf_counter() - started) / calls * 1000
    (out / f"rank{rank}.json").write_text(json.dumps(record))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
