"""The sample model: fields decoded by extension, per-field collation, length measures, an
open pipeline (transforms, recipes, user stages), epoch lengths and zero-copy batches."""

import gzip
import io
import json
import pickle

import numpy as np
import pytest

from conftest import pack_small
from seqshard import make_loader
from seqshard.errors import ConfigError, StateMismatchError
from seqshard.extend import Reader, Sample, Stage, default_recipe, keep_if
from seqshard.formats.fields import ABSENT, AudioBytes, decode_field, split_suffix
from seqshard.pipeline.stages.batching import Batch, LengthBudget, SortBatch
from seqshard.pipeline.stages.collate import Collator, FieldRule, speech_rules
from seqshard.pipeline.stages.lengths import Length, TotalLength
from seqshard.testing import ListSource, assert_resumes_everywhere, batch_slots, worker_setup

SMALL = dict(shuffle_window=12, sort_window=8, interleave=2)


def npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=True)
    return buffer.getvalue()


def test_fields_are_named_by_suffix_and_decoded_by_extension_never_unpickled():
    assert split_suffix("feats.npy") == ("feats", "npy", False)
    assert split_suffix("txt") == ("txt", "txt", False)
    assert split_suffix("txt.gz") == ("txt", "txt", True)
    assert split_suffix("audio.pth") == ("audio.pth", "pth", False)  # undecoded: named by its whole suffix (issue 17)
    array = np.arange(12, dtype=np.float32).reshape(3, 4)
    np.testing.assert_array_equal(decode_field("feats.npy", npy_bytes(array)), array)
    assert decode_field("txt", "héllo wörld".encode()) == "héllo wörld"
    assert decode_field("txt.gz", gzip.compress(b"zipped")) == "zipped"
    assert decode_field("meta.json", b'{"speaker": 3, "gender": "f"}') == {"speaker": 3, "gender": "f"}
    audio = decode_field("wav", b"RIFF....WAVE")
    assert isinstance(audio, AudioBytes) and audio.format == "wav" and bytes(audio.data) == b"RIFF....WAVE"
    assert decode_field("ali.nodata", b"") is ABSENT

    class Exploit:
        def __reduce__(self):
            return (print, ("pwned",))

    pickled = pickle.dumps(Exploit())
    assert decode_field("audio.pth", pickled) == pickled  # unknown extensions stay bytes
    assert decode_field("x.pickle", pickled) == pickled
    with pytest.raises(ValueError, match="Python objects"):
        decode_field("obj.npy", npy_bytes(np.array([{"a": 1}], dtype=object)))
    with pytest.raises(ValueError, match=r"not valid \.txt"):
        decode_field("txt", b"\xff\xfe bad")


def sample(key, **fields):
    return Sample(key, fields)


def test_collation_is_per_field_with_lengths_and_absent_values():
    samples = [
        sample(
            "a",
            feats=np.ones((3, 2), np.float32),
            tokens=np.array([5, 6], np.int64),
            txt="x y",
            ali=np.array([1, 1, 2], np.int32),
            spk=7,
            meta={"g": "f"},
        ),
        sample("b", feats=np.full((1, 2), 2, np.float32), tokens=np.array([9], np.int64), txt="z", spk=8),
    ]
    out = Collator(speech_rules("feats", -1, "float32"))(Batch(samples, [3, 1]))
    assert sorted(out) == [
        "ali",
        "ali_lens",
        "feat_lens",
        "feats",
        "keys",
        "label_lens",
        "labels",
        "meta",
        "spk",
        "texts",
    ]
    np.testing.assert_array_equal(out["feats"], [[[1, 1], [1, 1], [1, 1]], [[2, 2], [0, 0], [0, 0]]])
    assert out["feat_lens"].tolist() == [3, 1] and out["feats"].dtype == np.float32
    assert out["labels"].tolist() == [[5, 6], [9, -1]] and out["label_lens"].tolist() == [2, 1]
    assert out["ali"].tolist() == [[1, 1, 2], [0, 0, 0]] and out["ali_lens"].tolist() == [3, -1]
    assert out["ali"].dtype == np.int32
    assert out["spk"].tolist() == [7, 8] and out["texts"] == ["x y", "z"] and out["meta"] == [{"g": "f"}, None]
    assert out["keys"] == ["a", "b"]
    half = Collator([FieldRule("feats", "x", "x_len", pad=-5.0, dtype="float16")])(Batch(samples, [3, 1]))
    assert half["x"].dtype == np.float16 and half["x"][1, 1, 0] == -5 and half["x_len"].tolist() == [3, 1]


def test_length_measures_name_their_field_and_drive_batching():
    samples = [
        sample(f"s{i}", src=np.zeros(n, np.int64), tgt=np.zeros(2 * n, np.int64)) for i, n in enumerate(range(1, 21))
    ]
    assert Length("src", "tokens")(samples[4]) == 5 and TotalLength(("src", "tgt"))(samples[4]) == 15
    assert Length(None)(samples[4]) == 1
    batches = list(SortBatch(ListSource(samples), 20, LengthBudget(60), 0, length=TotalLength(("src", "tgt"))))
    for batch in batches:
        lengths = [3 * len(s["src"]) for s in batch.samples]
        assert batch.lengths == lengths and len(batch) * max(lengths) <= 60
    assert sorted(s.key for b in batches for s in b.samples) == sorted(s.key for s in samples)
    quadratic = LengthBudget(1000, quadratic=100)
    assert quadratic.cost(2, 50) == 2 * (50 + 2500 / 100) and not quadratic.fits(20, 50)


class Jitter(Stage):
    """A user stage: adds per-sample noise drawn from reader.sample_rng, counts what it saw."""

    def __init__(self, source, reader):
        super().__init__(source)
        self.reader = reader
        self.seen = 0

    def reset(self, state=None):
        super().reset(state)
        self.seen = state["seen"] if state else 0

    def next(self):
        item = self.source.next()
        self.seen += 1
        noise = self.reader.sample_rng(100, item).standard_normal()
        item.fields["feats"] = item.fields["feats"] + np.float32(noise)
        item.fields["noise"] = np.float32(noise)
        return item

    def get_state(self):
        return {**super().get_state(), "seen": self.seen}

    def stats(self):
        return {**super().stats(), "jitter.seen": self.seen}


def upper_text(sample):
    sample.fields["txt"] = sample.fields["txt"].upper()
    return sample


def long_enough(sample):
    return len(sample["feats"]) >= 15


def my_recipe(reader):
    samples = Jitter(reader.labels(reader.read()), reader)
    return reader.batch(reader.shuffle(samples))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return pack_small(tmp_path_factory.mktemp("corpus"))


def test_transforms_functions_filters_and_user_stages_with_exact_resume(corpus):
    options = dict(batch_size=4, transforms=[upper_text, keep_if(long_enough, "short"), Jitter], seed=3, **SMALL)
    for workers in (0, 2):
        loader = make_loader(corpus.pattern, num_workers=workers, **options)
        batches = list(loader)
        keys = [k for b in batches for k in b["keys"]]
        expected = [k for k, a in corpus.data.arrays.items() if len(a) >= 15]
        assert sorted(keys) == sorted(expected)
        assert loader.stats()["filtered"] == {"short": 48 - len(expected)}
        for batch in batches:
            for row, key in enumerate(batch["keys"]):
                assert batch["texts"][row] == corpus.data.labels[key].upper()
                length = int(batch["feat_lens"][row])
                original = corpus.data.arrays[key]
                np.testing.assert_allclose(
                    batch["feats"][row, :length].numpy() - original, batch["noise"][row].item(), atol=1e-5
                )
        # the noise of a sample depends on its key and epoch only, not on workers or resume
        noise = {k: float(n) for b in batches for k, n in zip(b["keys"], b["noise"])}
        if workers == 0:
            reference = noise
        assert noise == reference

        half = make_loader(corpus.pattern, num_workers=workers, **options)
        iterator = iter(half)
        head = [next(iterator)["keys"] for _ in range(3)]
        state = json.loads(json.dumps(half.state_dict()))
        del iterator
        resumed = make_loader(corpus.pattern, num_workers=workers, **options)
        resumed.load_state_dict(state)
        assert head + [b["keys"] for b in resumed] == [b["keys"] for b in batches]


def test_a_custom_recipe_and_a_user_stage_resume_everywhere(corpus):
    loader = make_loader(corpus.pattern, batch_size=5, recipe=my_recipe, num_workers=0, **SMALL)
    setup = worker_setup(loader)
    units = setup.units(0, 0)
    assert_resumes_everywhere(lambda: my_recipe(Reader(setup, 0, 0, units=units)))
    assert_resumes_everywhere(lambda: default_recipe(Reader(setup, 0, 0, units=units)))
    keys = [k for b in loader for k in b["keys"]]
    assert sorted(keys) == sorted(corpus.data.keys)
    assert all(
        "noise" in b for b in make_loader(corpus.pattern, batch_size=5, recipe=my_recipe, num_workers=2, **SMALL)
    )
    with pytest.raises(ConfigError, match="transforms takes functions"):
        make_loader(corpus.pattern, transforms=["not a function"])


def set_like_a_dict(sample):
    sample["feats"] = sample["feats"] * 2
    return sample


def returns_a_dict(sample):
    return {"feats": sample["feats"], "txt": sample["txt"]}


@pytest.mark.parametrize(
    ("transform", "error", "said"),
    [
        (set_like_a_dict, TypeError, r"'Sample' object does not support item assignment \(in set_like_a_dict\)"),
        (lambda sample: sample.get("txt") or sample, AttributeError, r"'Sample' object has no attribute 'get'"),
        (returns_a_dict, TypeError, r"returns_a_dict returned dict, not the sample"),
        (keep_if(lambda sample: sample.items(), "x"), AttributeError, r"has no attribute 'items'"),
    ],
)
def test_a_dict_style_transform_is_told_what_a_sample_offers(corpus, transform, error, said):
    """It got a bare TypeError/AttributeError (issue 23, item 20)."""
    loader = make_loader(corpus.pattern, batch_size=4, transforms=[transform], num_workers=0, **SMALL)
    with pytest.raises(error, match=said + r".*gets a seqshard Sample, not a dict: .*sample.fields\['feats'\] = value"):
        next(iter(loader))


def test_epoch_steps_and_hours_cut_epochs_in_any_mode_where_they_make_sense(corpus):
    stop = make_loader(corpus.pattern, batch_size=2, epoch_steps=5, num_workers=2, **SMALL)
    for epoch in range(2):
        stop.set_epoch(epoch)
        assert len(list(stop)) == 5
        summary = stop.last_summary["ranks"][0]
        assert summary["planned"] == 48 and summary["left"] == 48 - summary["utts"] == 38
    join = make_loader(corpus.pattern, batch_size=2, uneven="join", epoch_steps=7, num_workers=0, **SMALL)
    assert len(list(join)) == 7
    hours = 200 * 0.01 / 3600  # 200 frames
    by_hours = make_loader(corpus.pattern, batch_size=2, epoch_hours=hours, num_workers=0, **SMALL)
    frames = sum(int(b["feat_lens"].sum()) for b in by_hours)
    assert 200 <= frames < 200 + 2 * 60
    with pytest.raises(ConfigError, match="uneven='join' does not"):
        make_loader(corpus.pattern, uneven="join", epoch_hours=1.0)
    with pytest.raises(ConfigError, match="at most one of epoch_steps, epoch_hours or epoch_source"):
        make_loader(corpus.pattern, epoch_steps=3, epoch_hours=1.0)


def test_batches_are_the_shared_memory_the_worker_wrote_and_views_outlive_slot_reuse(corpus):
    loader = make_loader(corpus.pattern, batch_size=3, num_workers=2, prefetch_factor=1, **SMALL)
    slots = batch_slots(loader)
    start, end = slots.address(0), slots.address(slots.workers * slots.per_worker)  # the whole ring
    reference = []
    for batch in loader:
        # no copy: the tensors are the slot the worker wrote (feats and labels alike)
        assert all(start <= batch[k].data_ptr() < end for k in ("feats", "feat_lens"))
        reference.append(batch["keys"])
    assert len(reference) > 2 * slots.per_worker  # every slot was reused
    kept = []
    for number, batch in enumerate(loader):  # the same epoch again, keeping views of some batches
        if number % 3 == 0:
            kept.append((batch["keys"], batch["feat_lens"].clone(), batch["feats"][:, :5]))
    for keys, lengths, view in kept:  # a slot is reused only once no tensor or view uses it
        for row, key in enumerate(keys):
            length = min(int(lengths[row]), 5)
            np.testing.assert_array_equal(view[row, :length].numpy(), corpus.data.arrays[key][:length])
    copying = make_loader(corpus.pattern, batch_size=3, num_workers=2, shared_slots=False, **SMALL)
    assert [b["keys"] for b in copying] == reference


def test_a_state_from_another_version_is_refused_clearly(corpus):
    loader = make_loader(corpus.pattern, batch_size=4, num_workers=0)
    state = loader.state_dict()
    state["seqshard_loader_state"] = 1
    with pytest.raises(StateMismatchError, match="it is version 1, this seqshard reads 2"):
        make_loader(corpus.pattern, batch_size=4, num_workers=0).load_state_dict(state)
