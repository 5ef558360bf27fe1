"""Features holding NaN or infinity: `seqshard cmvn` leaves their frames out of its statistics and
names them (and takes exactly --max-utts utterances); the loader's check_finite drops such
samples, counted under dropped["non_finite"]."""

import json

import numpy as np
import pytest

from seqshard import make_loader
from seqshard.cli import main
from seqshard.formats.npy import npy_parts
from seqshard.formats.tar import ShardWriter

UTTS = 70  # more than one batch of `seqshard cmvn` (64)
BAD = {"utt-03": (1, np.nan), "utt-66": (0, np.inf)}  # key -> (frame, value)


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """70 utterances of 3-6 frames x 2 dims; utt-03 has a NaN frame, utt-66 an infinite one."""
    rng = np.random.default_rng(0)
    arrays = {f"utt-{n:02d}": rng.standard_normal((3 + n % 4, 2)).astype(np.float32) for n in range(UTTS)}
    for key, (frame, value) in BAD.items():
        arrays[key][frame, 1] = value
    path = tmp_path_factory.mktemp("nan") / "data-00000.tar"
    writer = ShardWriter(path)
    for key, array in arrays.items():
        writer.add(key, [("feats.npy", npy_parts(array)), ("txt", [b"a b"])])
    writer.commit()
    return path, arrays


def test_cmvn_leaves_non_finite_frames_out_and_names_their_utterances(shard, tmp_path, capsys):
    path, arrays = shard
    out = tmp_path / "cmvn.json"
    assert main(["cmvn", str(path), "-o", str(out)]) == 0
    stats = json.loads(out.read_text())
    frames = np.concatenate(list(arrays.values())).astype(np.float64)
    finite = frames[np.isfinite(frames).all(axis=1)]
    np.testing.assert_allclose(stats["mean"], finite.mean(axis=0), rtol=1e-6)
    np.testing.assert_allclose(stats["std"], finite.std(axis=0), rtol=1e-6)
    assert stats["frames"] == len(frames) - 2 and stats["utterances"] == UTTS
    assert stats["non_finite"] == {"frames": 2, "utterances": 2, "first_keys": stats["non_finite"]["first_keys"]}
    assert sorted(stats["non_finite"]["first_keys"]) == sorted(BAD)
    assert "2 frames of 2 utterances hold NaN or infinity" in capsys.readouterr().err


def test_cmvn_max_utts_takes_exactly_that_many_utterances(shard, tmp_path, capsys):
    """The first max_utts utterances the loader gives (66 took all 70 before: whole batches of 64)."""
    path, arrays = shard
    max_utts = 66
    out = tmp_path / "cmvn.json"
    assert main(["cmvn", str(path), "-o", str(out), "--max-utts", str(max_utts)]) == 0
    stats = json.loads(out.read_text())
    given = [key for batch in make_loader(path, batch_size=64, shuffle=False, num_workers=0) for key in batch["keys"]]
    first = np.concatenate([arrays[key] for key in given[:max_utts]]).astype(np.float64)
    first = first[np.isfinite(first).all(axis=1)]
    assert stats["utterances"] == max_utts and stats["frames"] == len(first)
    np.testing.assert_allclose(stats["mean"], first.mean(axis=0), rtol=1e-6)
    assert main(["cmvn", str(path), "-o", str(out), "--max-utts", "0"]) == 1
    assert "max_utts must be >= 1, got 0" in capsys.readouterr().err


def test_check_finite_drops_and_counts_samples_with_non_finite_features(shard):
    path, arrays = shard
    loader = make_loader(path, batch_size=8, num_workers=0, check_finite=True, seed=1)
    keys = [key for batch in loader for key in batch["keys"]]
    assert sorted(keys) == sorted(set(arrays) - set(BAD))
    assert loader.stats()["dropped"] == {"non_finite": 2}
    assert len(keys) + sum(loader.stats()["dropped"].values()) == UTTS
    unchecked = make_loader(path, batch_size=8, num_workers=0)
    assert sum(len(batch["keys"]) for batch in unchecked) == UTTS  # off by default: batches hold them


@pytest.mark.parametrize("mean, std", [([0.0, float("nan")], [1.0, 1.0]), ([0.0, 0.0], [1.0, float("inf")])])
def test_a_cmvn_file_with_non_finite_statistics_is_refused(tmp_path, mean, std):
    from seqshard.errors import ConfigError
    from seqshard.features.frontend import Cmvn

    (tmp_path / "cmvn.json").write_text(json.dumps({"mean": mean, "std": std}))
    with pytest.raises(ConfigError, match=r"cmvn\.json': mean and std must be vectors of one length, finite"):
        Cmvn.load(tmp_path / "cmvn.json")
