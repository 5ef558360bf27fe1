"""Train a small CTC model (conv subsampling + LSTM) with DDP from seqshard shards.

    python examples/train_ddp.py                                   # one process, a made-up corpus
    torchrun --nproc_per_node 2 examples/train_ddp.py              # 2 processes (gloo on CPU, nccl on GPU)
    torchrun --nproc_per_node 8 examples/train_ddp.py --config hyper-p.json --out exp/ctc

Everything goes into --out (default train-out/, ignored by git): the checkpoint OUT/ckpt.pt
and, without --config, a made-up corpus in OUT/data (features drawn from the labels, so the
loss goes down). A config is a CAT-style hyper-p.json whose train.option holds the data keys
(large_dataset, trset, devset, tokenizer), any make_loader option and the trainer's keys
(epochs, lr, warmup_steps, save_every, log_every, hidden, layers): `seqshard config --explain`
shows them. `--set KEY=JSON` overrides one.

Kill it at any point and run the same command again: it continues from the last checkpoint
with exactly the next batch, and the epoch and step counters where they were. To stop it with
a checkpoint, send SIGTERM (or SIGUSR1) to the ranks, not to torchrun (which exits 1 after a
signal, whatever its ranks did): `pkill -TERM -P TORCHRUN_PID`; every rank saves at one step
and exits 0, and so does torchrun. The README's Slurm script does this for a job. Run again after
the last epoch, it says the run is finished. Run again with other settings and it names each
change: a new learning rate or warm-up applies from the next step, another model shape
(hidden, layers) or tokenizer is refused (the checkpoint's weights cannot take it).

Every log_every steps rank 0 prints the loss, utterances/s, frames/s and the data-wait
fraction (time waiting for the next batch / step time).

The trainer itself is seqshard/app/trainer.py (so that `seqshard demo` runs it from an installed
package too).
"""

import sys

from seqshard.app.trainer import main

if __name__ == "__main__":
    sys.exit(main())
