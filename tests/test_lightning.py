"""seqshard in PyTorch Lightning (examples/lightning_module.py): a LightningDataModule whose
loader Lightning iterates epoch after epoch, sizes with len(), and resumes through its own
checkpoint, mid-epoch, at exactly the next batch."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from conftest import pack_small

sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))


def fit(pattern: str, folder: Path, max_steps: int, every: int | None = None, ckpt: str | None = None):
    # imported here, by the test process that runs the test: Lightning takes seconds to import,
    # which every test process would spend on collecting this file
    import lightning_module as example

    data = example.ShardDataModule(pattern, batch_size=4, num_workers=0, sort_window=8, shuffle_window=8)
    data.setup("fit")
    model = example.FrameAverage(data.train.loader.dim)
    example.trainer(max_steps, str(folder), every).fit(model, datamodule=data, ckpt_path=ckpt)
    return model.keys, data


@pytest.mark.slow
def test_lightning_trains_epochs_and_resumes_from_its_checkpoint_at_the_next_batch(tmp_path):
    pytest.importorskip("lightning")
    packed = pack_small(tmp_path / "p", utts_per_file=10, speakers=6, per_speaker=8)  # 48 utterances: 12 batches
    full, data = fit(packed.pattern, tmp_path / "full", 30)
    assert len(data.train) == 12
    epochs = [full[:12], full[12:24]]
    assert all(sorted(k for b in epoch for k in b) == sorted(packed.data.keys) for epoch in epochs)
    assert epochs[0] != epochs[1]  # each epoch in a new order, with no set_epoch from Lightning
    head, _ = fit(packed.pattern, tmp_path / "part", 17, every=17)  # a checkpoint inside epoch 1
    (checkpoint,) = (tmp_path / "part").glob("*step=17.ckpt")
    rest, _ = fit(packed.pattern, tmp_path / "rest", 30, ckpt=str(checkpoint))
    assert head + rest == full
