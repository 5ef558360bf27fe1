"""make_loader with real DataLoader worker processes."""

import json

import numpy as np
import pytest

from conftest import REALDATA, pack_small
from seqshard import make_loader, pack_data
from seqshard.errors import ConfigError, InputError, ShardError, StateMismatchError

SMALL = dict(shuffle_window=12, sort_window=8, interleave=2)


def epoch_keys(loader, epoch=0):
    loader.set_epoch(epoch)
    return [b["keys"] for b in loader]


@pytest.mark.parametrize("num_workers", [0, 1, 3])
def test_every_utterance_exactly_once_per_epoch(packed, num_workers):
    loader = make_loader(packed.pattern, batch_size=4, num_workers=num_workers, **SMALL)
    for epoch in range(2):
        keys = [k for batch in epoch_keys(loader, epoch) for k in batch]
        assert sorted(keys) == sorted(packed.data.keys)


def test_batches_hold_the_packed_arrays_padded(packed):
    loader = make_loader(packed.pattern, batch_size=5, num_workers=2, **SMALL)
    for batch in loader:
        assert str(batch["feats"].dtype) == "torch.float32" and str(batch["feat_lens"].dtype) == "torch.int64"
        for row, key in enumerate(batch["keys"]):
            length = int(batch["feat_lens"][row])
            np.testing.assert_array_equal(batch["feats"][row, :length].numpy(), packed.data.arrays[key])
            assert not batch["feats"][row, length:].any()
            assert batch["texts"][row] == packed.data.labels[key]


def test_same_seed_same_batches_new_epoch_new_order(packed):
    def run(seed, epoch, workers):
        return epoch_keys(make_loader(packed.pattern, batch_frames=120, seed=seed, num_workers=workers, **SMALL), epoch)

    assert run(7, 0, 2) == run(7, 0, 2)
    assert run(7, 0, 2) != run(7, 1, 2)
    assert run(7, 0, 2) != run(8, 0, 2)
    loader = make_loader(packed.pattern, batch_frames=120, seed=7, num_workers=2, **SMALL)
    assert epoch_keys(loader, 0) == run(7, 0, 2)  # a loader reused across epochs is the same


def test_shuffle_false_is_a_fixed_order_for_dev_sets(packed):
    first = epoch_keys(make_loader(packed.pattern, batch_size=4, shuffle=False, num_workers=0), 0)
    assert first == epoch_keys(make_loader(packed.pattern, batch_size=4, shuffle=False, num_workers=0), 3)


def test_dynamic_batches_stay_within_the_padded_frame_budget(packed):
    budget = 150
    loader = make_loader(packed.pattern, batch_frames=budget, num_workers=2, **SMALL)
    batches = list(loader)
    assert all(b["feats"].shape[0] * b["feats"].shape[1] <= budget or b["feats"].shape[0] == 1 for b in batches)
    assert sum(len(b["keys"]) for b in batches) == 48
    quadratic = list(make_loader(packed.pattern, batch_frames=budget, quadratic_frames=50, num_workers=0, **SMALL))
    for b in quadratic:
        longest = b["feats"].shape[1]
        assert b["feats"].shape[0] * (longest + longest**2 / 50) <= budget or b["feats"].shape[0] == 1
    assert len(quadratic) > len(batches)


def test_stats_report_padding_drops_and_speed(packed):
    loader = make_loader(packed.pattern, batch_frames=150, num_workers=2, min_frames=20, **SMALL)
    list(loader)
    stats = loader.stats()
    too_short = sum(1 for a in packed.data.arrays.values() if a.shape[0] < 20)
    assert stats["filtered"] == {"too_few_frames": too_short} and stats["utts"] == 48 - too_short
    assert 0 <= stats["padding_fraction"] < 0.5 and stats["utts_per_second"] > 0
    assert stats["units_done"] >= 5  # a shard split between the two workers counts twice
    assert loader.last_summary["ranks"][0]["left"] == 0


def test_sentencepiece_tokenization_on_the_fly(tmp_path):
    packed = pack_small(tmp_path, speakers=1, per_speaker=3)
    model = REALDATA / "tokenizers" / "librispeech.train_960_unigram5000.bpemodel"
    text = tmp_path / "relabel"
    keys = packed.data.keys
    text.write_text(f"{keys[0]} IT WAS THE FIRST GREAT SORROW OF HIS LIFE\n{keys[1]} IT WAS\n{keys[2]} LIFE\n")
    loader = make_loader(packed.pattern, str(model), labels=str(text), batch_size=3, shuffle=False, num_workers=0)
    assert loader.tokenizer.vocab_size == 5000
    (batch,) = list(loader)
    row = batch["keys"].index(keys[0])
    assert batch["labels"][row].tolist() == [15, 14, 3, 138, 119, 1506, 6, 17, 170]
    assert batch["texts"][row] == "IT WAS THE FIRST GREAT SORROW OF HIS LIFE"
    expected = {keys[0]: [15, 14, 3, 138, 119, 1506, 6, 17, 170], keys[1]: [15, 14], keys[2]: [170]}
    for row, key in enumerate(batch["keys"]):
        length = int(batch["label_lens"][row])
        assert batch["labels"][row, :length].tolist() == expected[key]
        assert (batch["labels"][row, length:] == -1).all()


def test_units_file_chars_words_unknowns_and_stripped_spaces(tmp_path):
    packed = pack_small(tmp_path, speakers=1, per_speaker=2)
    units = tmp_path / "units.txt"
    units.write_text("<blank> 0\n<unk> 1\n甚 2\n至 3\n出 4\n现 5\n▁ 6\nhello 7\n")
    text = tmp_path / "text"
    k0, k1 = packed.data.keys
    text.write_text(f"{k0} 甚至 出现\n{k1} hello world\n")
    chars = next(
        iter(make_loader(packed.pattern, units, labels=text, split="char", batch_size=2, shuffle=False, num_workers=0))
    )
    labels = {k: [t for t in row.tolist() if t != -1] for k, row in zip(chars["keys"], chars["labels"])}
    assert labels[k0] == [2, 3, 6, 4, 5]
    stripped = next(
        iter(
            make_loader(
                packed.pattern,
                units,
                labels=text,
                split="char",
                strip_spaces=True,
                batch_size=2,
                shuffle=False,
                num_workers=0,
            )
        )
    )
    assert [t for t in stripped["labels"][stripped["keys"].index(k0)].tolist() if t != -1] == [2, 3, 4, 5]
    words = next(
        iter(
            make_loader(
                packed.pattern,
                units,
                labels=text,
                split="word",
                batch_size=2,
                shuffle=False,
                pad_label=0,
                num_workers=0,
            )
        )
    )
    assert words["labels"][words["keys"].index(k1)].tolist() == [7, 1]


def test_label_override_replaces_by_key_and_missing_keys_are_errors_or_counted(packed, tmp_path):
    text = tmp_path / "relabel"
    keys = packed.data.keys
    text.write_text("".join(f"{k} NEW {i}\n" for i, k in enumerate(keys[:-3])))
    with pytest.raises(InputError, match="no line for this key"):
        list(make_loader(packed.pattern, labels=text, batch_size=4, num_workers=0, **SMALL))
    loader = make_loader(packed.pattern, labels=text, batch_size=4, skip_bad=True, num_workers=2, **SMALL)
    texts = {k: t for b in loader for k, t in zip(b["keys"], b["texts"])}
    assert len(texts) == 45 and all(t.startswith("NEW ") for t in texts.values())
    assert loader.stats()["dropped"] == {"no_label": 3}
    text.write_text(text.read_text() + f"{keys[0]} AGAIN\n")
    with pytest.raises(InputError, match=r"relabel:46 \(key '.*'\): the key already has a label at .*relabel:1"):
        make_loader(packed.pattern, labels=text, batch_size=4)


def test_a_shard_from_webdatasets_own_writer_loads(tmp_path):
    import webdataset as wds

    rng = np.random.default_rng(0)
    arrays = {
        f"sample{i:04d}": rng.standard_normal((int(rng.integers(3, 30)), 6)).astype(np.float32) for i in range(25)
    }
    with wds.TarWriter(str(tmp_path / "wds-000000.tar")) as sink:
        for key, array in arrays.items():
            sink.write({"__key__": key, "feats.npy": array, "txt": f"text of {key}"})
    loader = make_loader(str(tmp_path / "wds-*.tar"), batch_size=4, num_workers=2, **SMALL)
    seen = {}
    for batch in loader:
        for row, key in enumerate(batch["keys"]):
            seen[key] = batch["feats"][row, : int(batch["feat_lens"][row])].numpy()
            assert batch["texts"][row] == f"text of {key}"
    assert sorted(seen) == sorted(arrays)
    for key, array in arrays.items():
        np.testing.assert_array_equal(seen[key], array)


def test_fewer_shards_than_readers_leaves_no_reader_idle(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=100, speakers=2, per_speaker=9)
    loader = make_loader(packed.pattern, batch_size=2, num_workers=3, **SMALL)
    keys = [k for b in loader for k in b["keys"]]
    assert sorted(keys) == sorted(packed.data.keys)
    workers = loader.state_dict()["ranks"]["0"]["workers"]
    assert [w["stats"]["utts_read"] for w in workers] == [6, 6, 6] and all(
        w["pulled"] > 0 for w in workers
    )  # a third each
    (packed.out / "index.json").unlink()  # unindexed: readers take every 3rd utterance
    keys = [k for b in make_loader(packed.pattern, batch_size=2, num_workers=3, **SMALL) for k in b["keys"]]
    assert sorted(keys) == sorted(packed.data.keys)


def test_persistent_workers_and_pinned_memory_across_epochs(packed):
    loader = make_loader(
        packed.pattern, batch_size=4, num_workers=2, persistent_workers=True, pin_memory=False, **SMALL
    )
    first, second = epoch_keys(loader, 0), epoch_keys(loader, 1)
    assert sorted(k for b in first for k in b) == sorted(k for b in second for k in b) == sorted(packed.data.keys)
    assert first != second
    assert first == epoch_keys(make_loader(packed.pattern, batch_size=4, num_workers=2, **SMALL), 0)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_state_round_trip_mid_epoch_gives_the_same_next_batches(packed, num_workers):
    options = dict(batch_frames=100, num_workers=num_workers, seed=3, **SMALL)
    full = epoch_keys(make_loader(packed.pattern, **options), 2)
    for cut in (0, 1, len(full) // 2, len(full) - 1, len(full)):
        loader = make_loader(packed.pattern, **options)
        loader.set_epoch(2)
        iterator = iter(loader)
        head = [next(iterator)["keys"] for _ in range(cut)]
        state = json.loads(json.dumps(loader.state_dict()))
        del iterator
        resumed = make_loader(packed.pattern, **options)
        resumed.load_state_dict(state)
        assert head + epoch_keys(resumed, 2) == full, cut
        assert len(json.dumps(state)) < 20000


def test_states_from_other_settings_are_refused(packed):
    loader = make_loader(packed.pattern, batch_size=4, num_workers=2, **SMALL)
    state = loader.state_dict()
    with pytest.raises(StateMismatchError, match="num_workers was 2, now 1"):
        make_loader(packed.pattern, batch_size=4, num_workers=1, **SMALL).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="option batch_size was 4, now 5"):
        make_loader(packed.pattern, batch_size=5, num_workers=2, **SMALL).load_state_dict(state)
    with pytest.raises(StateMismatchError, match="num_shards"):
        make_loader(f"{packed.out}/data-0000[0-3].tar", batch_size=4, num_workers=2, **SMALL).load_state_dict(state)


def test_options_are_checked_at_the_boundary(packed):
    with pytest.raises(ConfigError, match="unknown loader option"):
        make_loader(packed.pattern, batch_sise=3)
    with pytest.raises(ConfigError, match="exactly one of batch_size"):
        make_loader(packed.pattern, batch_size=3, batch_frames=100)
    with pytest.raises(ConfigError, match="selects no shard"):
        make_loader(f"{packed.out}/nope-*.tar")
    with pytest.raises(ConfigError, match="epoch_steps or epoch_hours"):
        make_loader(packed.pattern, uneven="repeat")


def test_audio_shards_load_as_waveforms_or_fbank_and_a_missing_feature_field_is_named(tmp_path):
    wenet = str(REALDATA / "webdataset/wenet-shard/shards_000000000.tar")
    (batch,) = list(make_loader(wenet, batch_size=2, shuffle=False, num_workers=0))
    assert sorted(batch) == ["audio", "audio_lens", "keys", "sample_rate", "texts"]
    assert batch["audio_lens"].tolist() == [68496, 139680] and batch["sample_rate"].tolist() == [16000, 16000]
    assert batch["texts"][0] == "广州市房地产中介协会分析"
    (fbank,) = list(make_loader(wenet, features="fbank", batch_frames=3000, shuffle=False, num_workers=0))
    assert sorted(fbank) == ["feat_lens", "feats", "keys", "texts"] and fbank["feat_lens"].tolist() == [426, 871]
    with pytest.raises(
        ConfigError, match=r"feature_field 'feats\.npy': the shards have no such field \(they have: txt, wav\)"
    ):
        make_loader(wenet, feature_field="feats.npy", batch_size=2)


def test_map_style_reader_for_unpacked_dev_sets(tmp_path):
    from conftest import write_kaldi_dir
    from seqshard import ScpDataset, make_scp_loader

    data = write_kaldi_dir(tmp_path / "dev", speakers=2, per_speaker=5, compression_method=2)
    dataset = ScpDataset(data.scp, data.text)
    assert len(dataset) == 10 and dataset[3].key == data.keys[3]
    np.testing.assert_array_equal(dataset[3]["feats"], data.arrays[data.keys[3]])
    batches = list(make_scp_loader(data.scp, data.text, batch_size=4, num_workers=2))
    assert [k for b in batches for k in b["keys"]] == data.keys
    assert batches[0]["feats"].shape[0] == 4 and batches[0]["texts"][0] == data.labels[data.keys[0]]


@pytest.mark.parametrize("num_workers,bucket", [(2, False), (0, False), (2, True)])
def test_elastic_resume_to_another_world_size_reads_the_rest_exactly_once(packed, num_workers, bucket):
    """Ranks simulated in one process (uneven='join' needs no collectives)."""
    options = dict(batch_size=3, num_workers=num_workers, uneven="join", seed=4, **SMALL)
    if bucket:
        options = {**options, "uneven": "stop", "bucket_sync": True, "num_buckets": 3}
    old = []
    seen_before = []
    for rank in range(2):
        loader = make_loader(packed.pattern, rank=rank, world_size=2 if not bucket else 1, **options)
        loader.set_epoch(1)
        iterator = iter(loader)
        for _ in range(3 + rank):
            seen_before.extend(next(iterator)["keys"])
        old.append(loader.state_dict(gather=False))
        del iterator
        if bucket:
            break
    state = {**old[0], "ranks": {k: v for s in old for k, v in s["ranks"].items()}}
    after = []
    new_world = 3
    for rank in range(new_world):
        loader = make_loader(
            packed.pattern,
            rank=rank,
            world_size=new_world,
            **{**options, "num_workers": 1, "batch_size": 2, "uneven": "join", "bucket_sync": False},
        )
        with pytest.raises(StateMismatchError):
            loader.load_state_dict(state)
        loader.load_state_dict(state, strict=False)
        loader.set_epoch(1)
        after.extend(k for b in loader for k in b["keys"])
    assert len(seen_before) + len(after) == 48
    assert sorted(seen_before + after) == sorted(packed.data.keys)


def test_damage_and_missing_files_are_named_or_counted(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    with pytest.raises(
        ShardError,
        match=r"5 selected shards are missing: data-00005\.tar \(named in the pattern, but it does not exist\)",
    ):
        make_loader(f"{packed.out}/data-0000{{0..9}}.tar")
    from seqshard.formats.tar import SampleStream

    shard = packed.out / "data-00001.tar"
    with SampleStream(shard) as stream:
        for _ in range(4):
            stream.next_sample()
        cut = stream.resume_offset
    shard.write_bytes(shard.read_bytes()[:cut])  # cut at a member boundary: still a valid tar prefix
    with pytest.raises(Exception, match=r"data-00001\.tar: the file has \d+ bytes where its index\.json says"):
        list(make_loader(packed.pattern, batch_size=4, num_workers=0, **SMALL))
    loader = make_loader(packed.pattern, batch_size=4, num_workers=2, skip_bad=True, max_bad_shards=1, **SMALL)
    keys = [k for b in loader for k in b["keys"]]
    # 6 of shard 1's 10 utterances are gone; the shard may be split between the two workers: one shard
    stats, summary = loader.stats(), loader.last_summary["ranks"][0]
    assert len(keys) == len(set(keys)) == 42 and stats["damaged_shards"] == 1
    assert stats["dropped"] == {"damaged": 6} and summary["left"] == 0  # every count adds up
    assert summary["utts"] + sum(summary["dropped"].values()) + summary["left"] == summary["planned"] == 48
    (packed.out / "data-00003.tar").unlink()
    (packed.out / "data-00003.tar").write_bytes(b"")  # unreadable when opened
    with pytest.raises(ShardError, match=r"\(2 damaged, 0 missing\): more than the 1 that max_bad_shards=1 allows"):
        list(make_loader(packed.pattern, batch_size=4, num_workers=0, skip_bad=True, max_bad_shards=1, **SMALL))
    loader = make_loader(packed.pattern, batch_size=4, num_workers=0, skip_bad=True, max_bad_shards=0.4, **SMALL)
    assert len([k for b in loader for k in b["keys"]]) == 32
    assert loader.stats()["damaged_shards"] == 2 and loader.stats()["dropped"] == {"damaged": 16}
    summary = loader.last_summary["ranks"][0]
    assert summary["utts"] + sum(summary["dropped"].values()) + summary["left"] == summary["planned"] == 48


def test_spawned_workers_get_the_same_batches(packed):
    """Workers started with 'spawn' (macOS, Python 3.14's default is forkserver) unpickle the
    dataset, the shared slots and the channel."""
    options = dict(batch_size=4, num_workers=2, seed=2, **SMALL)
    forked = epoch_keys(make_loader(packed.pattern, **options), 1)
    spawned = epoch_keys(make_loader(packed.pattern, multiprocessing_context="spawn", **options), 1)
    assert spawned == forked


def test_repeat_reads_each_utterance_once_per_pass_and_never_twice_in_a_batch(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=16, speakers=3, per_speaker=16)  # 3 shards of 16
    loader = make_loader(
        packed.pattern,
        batch_size=5,
        uneven="repeat",
        epoch_steps=40,
        num_workers=0,
        interleave=4,  # more than the reader's shards: the old reader opened the next pass early
        shuffle_window=100,
        sort_window=100,  # windows larger than a pass
    )
    batches = [b["keys"] for epoch in range(2) for b in epoch_keys_of(loader, epoch)]
    assert all(len(set(batch)) == len(batch) for batch in batches)
    stream = [k for batch in batches for k in batch]
    passes = [stream[i : i + 48] for i in range(0, len(stream) - 47, 48)]
    assert len(passes) >= 3
    for number, keys in enumerate(passes):
        assert sorted(keys) == sorted(packed.data.keys), f"pass {number} is not every utterance once"
    assert passes[0] != passes[1]  # each pass has its own order


def epoch_keys_of(loader, epoch):
    loader.set_epoch(epoch)
    return list(loader)


def test_a_units_file_of_words_is_split_into_words_and_unknown_tokens_are_counted(tmp_path, caplog):
    packed = pack_small(tmp_path, speakers=2, per_speaker=30)
    words = sorted({w for label in packed.data.labels.values() for w in label.split()})
    units = tmp_path / "words.txt"
    units.write_text("<blank> 0\n<unk> 1\n" + "".join(f"{w} {i + 2}\n" for i, w in enumerate(words)))
    loader = make_loader(packed.pattern, units, batch_size=8, num_workers=2)
    assert loader.tokenizer.split == "word"
    batches = list(loader)
    assert all((b["labels"][b["labels"] >= 0] > 1).all() for b in batches)  # no <unk>
    assert loader.stats()["unknown_tokens"] == 0 and loader.stats()["tokens"] == 60 * 3
    assert "unknown token" not in caplog.text
    forced = make_loader(packed.pattern, units, split="char", batch_size=8, num_workers=2)
    with caplog.at_level("WARNING", logger="seqshard"):
        list(forced)
    stats = forced.stats()
    assert stats["unknown_tokens"] == stats["tokens"] > 0
    assert "100% of the first" in caplog.text and "split='word'" in caplog.text


def test_escaped_keys_come_out_as_in_the_scp_and_label_files_use_them(tmp_path):
    import kaldiio

    root = tmp_path / "kaldi"
    root.mkdir()
    keys = [f"sp0.9-spk{i}/utt%{i}" for i in range(6)]
    with kaldiio.WriteHelper(f"ark,scp:{root}/a.ark,{root}/feats.scp") as writer:
        for i, key in enumerate(keys):
            writer(key, np.full((5 + i, 3), i, dtype=np.float32))
    (root / "text").write_text("".join(f"{k} old {i}\n" for i, k in enumerate(keys)))
    pack_data(root / "feats.scp", root / "text", tmp_path / "shards", escape_keys=True, progress=False)
    relabel = tmp_path / "relabel"
    relabel.write_text("".join(f"{k} new {i}\n" for i, k in enumerate(keys)))
    for workers in (0, 2):
        loader = make_loader(f"{tmp_path}/shards/*.tar", labels=relabel, batch_size=2, num_workers=workers)
        texts = {k: t for b in loader for k, t in zip(b["keys"], b["texts"])}
        assert texts == {k: f"new {i}" for i, k in enumerate(keys)}


def test_worker_errors_arrive_as_the_original_error_naming_the_shard(tmp_path):
    packed = pack_small(tmp_path, utts_per_file=10)
    shard = packed.out / "data-00003.tar"
    from seqshard.formats.tar import TarStream

    with TarStream(shard) as stream:
        stream.next_member()
        second = stream.position  # the header of the second member
    data = bytearray(shard.read_bytes())
    data[second + 10 : second + 20] = b"\xff" * 10
    shard.write_bytes(bytes(data))
    for workers in (0, 2):
        with pytest.raises(ShardError, match=rf"data-00003\.tar at byte {second}: tar header checksum mismatch"):
            list(make_loader(packed.pattern, batch_size=4, num_workers=workers, **SMALL))
    text = tmp_path / "relabel"
    text.write_text(f"{packed.data.keys[0]} only one\n")
    with pytest.raises(InputError, match="no line for this key"):
        list(make_loader(packed.pattern, labels=text, batch_size=4, num_workers=2, **SMALL))


def test_tokenizer_files_that_are_not_tokenizers_are_named(packed, tmp_path):
    with pytest.raises(ConfigError, match=r"is not a SentencePiece model"):
        make_loader(packed.pattern, packed.out / "data-00000.tar", batch_size=4)  # a .tar has a NUL byte
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("<unk> 0\n\xe9 1\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1\.txt: not UTF-8 text"):
        make_loader(packed.pattern, bad, batch_size=4)
    twice = tmp_path / "units.txt"
    twice.write_text("<unk> 1\na 1\n")
    with pytest.raises(ConfigError, match=r"units\.txt:2: id 1 already for '<unk>'"):
        make_loader(packed.pattern, twice, batch_size=4)
    with pytest.raises(ConfigError, match="is a folder"):
        make_loader(packed.pattern, tmp_path, batch_size=4)
    with pytest.raises(ConfigError, match="is a folder"):
        make_loader(packed.pattern, labels=tmp_path, batch_size=4)


def test_loader_options_are_checked_with_their_names(packed):
    bad = [
        (dict(pad_label="x"), "pad_label must be a whole number"),
        (dict(seed=-1), "seed must be >= 0"),
        (dict(recipe=42), "recipe must be a function"),
        (dict(min_frames=50, max_frames=10), "min_frames 50 is above max_frames 10"),
        (dict(max_frames_per_token=0), "max_frames_per_token must be > 0"),
        (dict(split_shards="no"), "split_shards must be True or False"),
        (dict(max_tokens=10), "count label tokens: give a tokenizer"),
    ]
    for options, message in bad:
        with pytest.raises(ConfigError, match=message):
            make_loader(packed.pattern, batch_size=4, **options)
    with pytest.raises(ConfigError, match="no shard pattern given"):
        make_loader("", batch_size=4)
    one = make_loader(packed.pattern, batch_size=4, transforms=lambda s: s, num_workers=0)  # one transform alone
    assert sum(len(b["keys"]) for b in one) == 48
    everything = make_loader(
        f"{packed.out.parent}/*", batch_size=4, num_workers=0
    )  # a glob's folders stand for their shards
    assert sum(len(b["keys"]) for b in everything) == 48


def test_texts_come_as_stored_and_tokens_from_the_stripped_text(tmp_path):
    """webdataset's decode keeps a .txt member as stored (its compressed.tar's end with a newline);
    so does the loader; the tokenizer reads it without the whitespace around it (issue 23, item 17)."""
    import gzip
    import tarfile

    shard = REALDATA / "webdataset/webdataset-testdata/compressed.tar"
    with tarfile.open(shard) as archive:
        stored = {
            m.name.split(".", 1)[0]: gzip.decompress(archive.extractfile(m).read()).decode()
            for m in archive.getmembers()
            if m.isfile()
        }
    units = tmp_path / "units.txt"
    units.write_text("<unk> 0\n▁ 1\n" + "".join(f"{c} {n}\n" for n, c in enumerate("deghiloprwz", start=2)))
    loader = make_loader(shard, units, batch_size=8, num_workers=0, shuffle=False)
    batch = next(iter(loader))
    assert dict(zip(batch["keys"], batch["texts"])) == stored and all(t.endswith("\n") for t in stored.values())
    for key, row in zip(batch["keys"], batch["labels"].tolist()):
        assert [t for t in row if t != -1] == [2 + "deghiloprwz".index(c) for c in stored[key].strip()]


def test_loaders_made_again_and_again_share_one_read_ahead_thread(packed):
    """A dev loader made each epoch left a read-ahead thread and its 8 MiB buffer behind each
    time (22 threads after 21 loaders): the process has one, whatever it makes."""
    import threading

    for _ in range(6):
        loader = make_loader(packed.pattern, batch_size=8, num_workers=0, shuffle=False)
        assert sum(len(batch["keys"]) for batch in loader) == len(packed.data.keys)
        del loader
    names = [thread.name for thread in threading.enumerate()]
    assert names.count("seqshard-prefetch") == 1, names
