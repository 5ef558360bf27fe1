"""Reading fields beside each other: each field set opened once, and encoded audio read beside
features crossing to the training process (both hit by a Lhotse Shar folder's default read)."""

import io

import numpy as np
import soundfile

from seqshard import make_loader
from seqshard.formats.fields import AudioBytes
from seqshard.formats.npy import npy_parts
from seqshard.formats.table import ShardInfo, ShardTable
from seqshard.formats.tar import ShardWriter
from seqshard.pipeline.stages.fieldplan import plan_fields


def rows(loader) -> dict[str, dict]:
    """Every sample of an epoch by key, each field cut out of its batch (None when absent);
    a key read twice fails."""
    out: dict[str, dict] = {}
    for batch in loader:
        for row, key in enumerate(batch["keys"]):
            sample = {}
            for name, value in batch.items():
                if name == "keys" or name.endswith("_lens"):
                    continue
                lengths = batch.get("feat_lens" if name == "feats" else f"{name}_lens")
                if lengths is not None:
                    length = int(lengths[row])
                    sample[name] = None if length < 0 else value[row, :length].numpy()
                else:
                    sample[name] = value[row] if isinstance(value, list) else value[row].item()
            assert key not in out, f"{key} read twice"
            out[key] = sample
    return out


# -- found on the way: defects that a Shar folder's default read (every field) ran into --------------


def test_a_field_set_is_opened_once_when_fields_name_the_shards_own_and_a_sidecars():
    table = ShardTable(
        (ShardInfo("data-00000.tar", 1024, sidecars=(("ali", "fields/ali/data-00000.tar"),)),),
        field_sets=(("", ("feats.npy", "txt")), ("ali", ("ali.npy",))),
    )
    assert plan_fields(table, ["feats", "ali"], None, False).sets == ("", "ali")  # was ("", "", "ali")


def test_encoded_audio_read_beside_features_crosses_to_the_training_process(tmp_path):
    writer = ShardWriter(tmp_path / "data-00000.tar")
    audio = io.BytesIO()
    soundfile.write(audio, np.zeros(800, np.float32), 16000, format="FLAC")
    for i in range(4):
        writer.add(
            f"k{i}", [("feats.npy", list(npy_parts(np.zeros((5, 2), np.float32)))), ("flac", [audio.getvalue()])]
        )
    writer.commit()
    got = rows(make_loader(tmp_path, batch_size=2, num_workers=2))
    assert sorted(got) == ["k0", "k1", "k2", "k3"]
    assert all(isinstance(row["flac"], AudioBytes) and row["flac"].data == audio.getvalue() for row in got.values())
