"""Batches handed over where training wants them: features made in torch from a batch of
waveforms (``feature_device``; its CPU path here, the GPU's in bench/device_check.py), the
order in which copies to a device start and hand over, and shared slots freed only once the
copy that reads them is done (events stood in for by plain objects: the ordering logic, not
CUDA)."""

import json
import multiprocessing

import numpy as np
import pytest
import soundfile
import torch

from conftest import REALDATA, write_audio_dir
from seqshard import make_loader, make_token_loader, pack_data
from seqshard.device import InFlight, one_ahead
from seqshard.errors import ConfigError
from seqshard.features.fbank import FbankOptions, fbank, num_frames
from seqshard.features.torch_fbank import fbank_batch
from seqshard.formats.peers.mmidx import TokenDatasetWriter
from seqshard.formats.remote.access import RemoteAccess
from seqshard.formats.table import ShardTable
from seqshard.options import LoaderOptions
from seqshard.pipeline.transport.slots import FREE, LEASED, BatchSlots
from seqshard.pipeline.workers.pool import WorkerPool
from seqshard.pipeline.workers.setup import make_setup

SMALL = dict(shuffle_window=8, sort_window=4, interleave=2, num_workers=0)


@pytest.fixture(scope="module")
def audio_shards(tmp_path_factory):
    root = tmp_path_factory.mktemp("device")
    data = write_audio_dir(root / "d", utts=10, seconds=(0.2, 0.9))
    pack_data(None, data.text, root / "shards", wav_scp=data.wav_scp, utts_per_file=4, progress=False)
    cmvn = root / "cmvn.json"
    cmvn.write_text(json.dumps({"mean": np.linspace(5, 9, 24).tolist(), "std": np.linspace(1, 2, 24).tolist()}))
    return root / "shards", cmvn


def _speech(window: int):
    """Kaldi-scale waveforms: two real utterances, a tone in noise, a pure tone, and pieces
    shorter than one ``window`` and of exactly one."""
    waves = [soundfile.read(REALDATA / path, dtype="int16")[0].astype(np.float64) for path in (
        "audio/librispeech/1995-1837-0001.wav", "audio/aishell1/BAC009S0724W0121.wav")]  # fmt: skip
    t = np.arange(8000) / 16000
    tone = 0.3 * np.sin(2 * np.pi * 440 * t) * 32767
    noise = np.random.default_rng(0).standard_normal(8000) * 600
    return [
        waves[0][:40000],
        waves[1][:24000],
        np.round(tone + noise),
        np.round(tone),
        waves[0][: window - 1],
        waves[1][:window],
    ]


@pytest.mark.parametrize(
    "options",
    [
        FbankOptions(),
        FbankOptions(num_mel_bins=23, use_energy=True, energy_floor=1.0),
        FbankOptions(sample_rate=8000, num_mel_bins=40, frame_length_ms=20, frame_shift_ms=8, use_power=False),
        FbankOptions(num_mel_bins=30, preemphasis=0.0, remove_dc_offset=False, window="hamming", use_log_fbank=False),
    ],
    ids=["kaldi-defaults", "energy", "8k-magnitude", "hamming-linear"],
)
def test_fbank_of_a_padded_batch_equals_the_workers_fbank_of_each_utterance(options):
    waves = _speech(options.window_size)
    padded = torch.zeros(len(waves), max(map(len, waves)))
    for row, wave in enumerate(waves):
        padded[row, : len(wave)] = torch.from_numpy(wave)
    counts = [num_frames(len(w), options) for w in waves]
    feats, frames = fbank_batch(padded, torch.tensor([len(w) for w in waves]), max(counts), options)
    assert frames.tolist() == counts and counts[-2:] == [0, 1] and feats.dtype == torch.float32
    for row, wave in enumerate(waves):
        expected = fbank(wave, options)
        got = feats[row].numpy()
        scale = 1 if options.use_log_fbank else max(1.0, float(np.abs(expected).max(initial=0)))  # linear: relative
        np.testing.assert_allclose(got[: counts[row]], expected, rtol=0, atol=1e-3 * scale)
        assert not got[counts[row] :].any()  # padded with zeros, as collated features are


def _batches(shards, **options):
    return list(make_loader(shards, **{**SMALL, "batch_size": 3, **options}))


def test_features_made_from_the_batch_equal_those_of_the_workers(audio_shards):
    shards, cmvn = audio_shards
    options = dict(features="fbank", num_mel_bins=24, cmvn=str(cmvn), spec_augment={"max_freq_width": 6}, seed=3)
    workers = _batches(shards, **options)
    loader = make_loader(shards, **{**SMALL, "batch_size": 3, **options, "feature_device": "cpu"})
    batch_made = list(loader)
    assert loader.dim == 24
    masked = 0
    for mine, theirs in zip(batch_made, workers, strict=True):
        assert set(mine) == set(theirs) == {"keys", "texts", "feats", "feat_lens"} and mine["keys"] == theirs["keys"]
        assert torch.equal(mine["feat_lens"], theirs["feat_lens"]) and mine["feats"].shape == theirs["feats"].shape
        torch.testing.assert_close(mine["feats"], theirs["feats"], rtol=0, atol=1e-3)
        assert torch.equal(mine["feats"] == 0, theirs["feats"] == 0)  # the same masks (and padding)
        masked += sum(int((row[:n] == 0).sum()) for row, n in zip(theirs["feats"], theirs["feat_lens"]))
    assert masked > 0  # masks were drawn (a zero within an utterance's frames is a mask's)


def test_features_made_from_the_batch_resume_exactly(audio_shards):
    shards, _ = audio_shards
    options = dict(SMALL, batch_size=3, features="fbank", num_mel_bins=24, spec_augment=True, feature_device="cpu")
    full = list(make_loader(shards, **options))
    loader = make_loader(shards, **options)
    iterator = iter(loader)
    head = [next(iterator) for _ in range(2)]
    state = json.loads(json.dumps(loader.state_dict()))
    del iterator
    resumed = make_loader(shards, **options)
    resumed.load_state_dict(state)
    for a, b in zip(head + list(resumed), full, strict=True):
        assert a["keys"] == b["keys"] and torch.equal(a["feats"], b["feats"])


def test_device_cpu_changes_nothing(audio_shards):
    shards, _ = audio_shards
    for plain, on_cpu in zip(_batches(shards), _batches(shards, device="cpu"), strict=True):
        assert plain["keys"] == on_cpu["keys"] and torch.equal(plain["audio"], on_cpu["audio"])
        assert on_cpu["audio"].device.type == "cpu"


def test_token_batches_on_cpu_are_unchanged(tmp_path):
    writer = TokenDatasetWriter(tmp_path / "lm", np.uint16)
    for length in range(1, 20):
        writer.add(np.arange(length) + 3)
    writer.finish()
    plain = list(make_token_loader(tmp_path / "lm", max_tokens=40))
    on_cpu = list(make_token_loader(tmp_path / "lm", max_tokens=40, device="cpu"))
    for a, b in zip(plain, on_cpu, strict=True):
        assert torch.equal(a["src_tokens"], b["src_tokens"]) and b["net_input"]["src_tokens"] is b["src_tokens"]
    with pytest.raises(ConfigError, match="device must be None, 'cpu', 'cuda' or 'cuda:N'"):
        make_token_loader(tmp_path / "lm", device="tpu")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            dict(features="fbank", feature_device="cpu", cmvn="{cmvn}"),
            "cmvn has statistics of 24 dimensions and fbank makes 80",
        ),
        (dict(features="fbank", feature_device="cpu", feature_field="txt"), "needs shards that hold audio"),
    ],
)
def test_features_made_from_the_batch_check_the_data_once(audio_shards, options, message):
    shards, cmvn = audio_shards
    options = {k: v.format(cmvn=cmvn) if isinstance(v, str) else v for k, v in options.items()}
    with pytest.raises(ConfigError, match=message):
        make_loader(shards, batch_size=2, num_workers=0, **options)


class _Event:
    """A copy's completion as an event reports it (query) and waits for it (synchronize)."""

    def __init__(self):
        self.done = False

    def query(self):
        return self.done

    def synchronize(self):
        self.done = True


def _leased_batch(slots):
    arena = slots.acquire(0, 64, iteration=1)
    array = arena.allocate((4,), np.dtype(np.float32))
    arrays = {"x": arena.describe(array)}
    slots.receive(arena.slot, arrays, pin=False)
    return arena.slot, arrays


def test_a_slot_goes_back_to_its_worker_only_when_the_copy_reading_it_is_done():
    slots = BatchSlots(1, 3, 1 << 10, multiprocessing.get_context())
    held, events = InFlight(), [_Event(), _Event()]
    first, host = _leased_batch(slots)
    held.hold(events[0], host)
    second, host = _leased_batch(slots)
    held.hold(events[1], host)
    del host
    held.release_done()
    assert slots.mark(first) == slots.mark(second) == LEASED  # both copies still running
    events[1].done = True
    held.release_done()  # the later copy is done, but copies complete in order: nothing is let go
    assert len(held) == 2 and slots.mark(first) == LEASED
    events[0].done = True
    held.release_done()  # (a slot is freed as its last tensor goes: no garbage collection needed)
    assert len(held) == 0 and slots.mark(first) == slots.mark(second) == FREE
    third, host = _leased_batch(slots)
    held.hold(_Event(), host)
    del host
    held.release_all()  # the end of an iteration waits for the copies still running
    assert slots.mark(third) == FREE


def test_a_pinned_slot_let_go_by_training_waits_for_its_fence():
    slots = BatchSlots(1, 2, 1 << 10, multiprocessing.get_context())
    slots.pinned = True  # as after cudaHostRegister: the user's own non_blocking copy may still read the slot
    fence = _Event()
    arena = slots.acquire(0, 64, iteration=1)
    place = arena.describe(arena.allocate((4,), np.dtype(np.float32)))
    tensors = {"x": place}
    slots.receive(arena.slot, tensors, pin=True, fence=lambda: fence)
    assert tensors["x"].data_ptr() == slots.address(arena.slot)
    del tensors
    slots.reclaim()
    assert slots.mark(arena.slot) == LEASED
    fence.done = True
    slots.reclaim()
    assert slots.mark(arena.slot) == FREE


def test_the_next_copy_starts_before_a_batch_is_handed_over_and_the_first_at_once():
    log = []

    def items():
        for item in ["b0", "b1", "b2", "b3"]:
            log.append(f"pull {item}")
            yield item

    def start(item):
        log.append(f"start {item}")
        return item

    def finish(item):
        log.append(f"hand {item}")
        return item

    out = list(one_ahead(items(), start, finish))
    assert out == ["b0", "b1", "b2", "b3"]
    assert log == [
        "pull b0", "start b0", "hand b0",  # the first batch: nothing else waited for
        "pull b1", "start b1", "pull b2", "start b2", "hand b1",  # b2 copies while b1's step runs
        "pull b3", "start b3", "hand b2",
        "hand b3",
    ]  # fmt: skip


class _RecordingCopier:
    """A CudaCopier's start and finish, recorded (a batch's name stands for its tensors)."""

    def __init__(self, log):
        self.log = log

    def start(self, batch):
        self.log.append(f"start {batch['name']}")
        return batch

    def finish(self, started):
        self.log.append(f"hand {started['name']}")
        return started


def test_the_rank_copies_the_next_turns_batch_before_handing_one_over_and_keeps_ends_and_errors_for_their_turn():
    from seqshard.pipeline.transport.delivery import CopiesAhead
    from seqshard.pipeline.transport.wire import BatchItem, EndItem

    log = []
    sent = {0: ["a0", "a1", "end"], 1: ["b0", "end"], 2: ["c0", "c1", "error"]}

    def take(worker):
        name = sent[worker].pop(0)
        log.append(f"take {name}")
        if name == "error":
            raise ValueError(f"worker {worker} failed")
        if name == "end":
            return EndItem(worker, 0, {})
        return BatchItem(worker, 0, {"name": name}, {}, {}, 1, 1, 1)

    ahead = CopiesAhead(take, _RecordingCopier(log), workers=3)
    handed = [ahead.take(worker) for worker in (0, 1, 2, 0, 1, 2, 0)]  # the merged stream's turns
    assert [item.batch["name"] if isinstance(item, BatchItem) else "end" for item in handed] == [
        "a0", "b0", "c0", "a1", "end", "c1", "end"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="worker 2 failed"):  # taken ahead, raised at its own turn
        ahead.take(2)
    assert log == [
        "take a0", "start a0", "hand a0",  # the first batch at once
        "take b0", "start b0", "hand b0", "take c0", "start c0",  # c0 copies while b0's step runs
        "hand c0", "take a1", "start a1",
        "hand a1", "take end",  # worker 1's end, kept for its turn
        "take c1", "start c1",
        "hand c1", "take end",
        "take error",  # worker 1 has ended: the next turn is worker 2's
    ]  # fmt: skip


@pytest.mark.parametrize("later", [None, "cpu"])
def test_a_batch_of_waveforms_as_large_as_the_budget_fits_its_slot(audio_shards, later):
    features = dict(features="fbank", feature_device=later) if later else {}
    options = LoaderOptions(batch_frames=20000, num_workers=0, **features)
    setup = make_setup(ShardTable.from_patterns(audio_shards[0]), options, 0, 1, None, None)
    slots = WorkerPool(setup, RemoteAccess()).runtime.slots
    assert slots.slot_bytes >= 20000 * 160 * 4  # 10 ms of float32 samples at 16 kHz a frame


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_asking_for_a_gpu_where_there_is_none_is_refused_when_the_loader_is_made(audio_shards, tmp_path):
    from seqshard.app.trainer import main

    with pytest.raises(ConfigError, match="device='cuda', and torch finds 0 CUDA device"):
        make_loader(audio_shards[0], batch_size=2, num_workers=0, device="cuda")
    assert main(["--device", "cuda", "--out", str(tmp_path)]) == 1  # the example trainer says so and stops


def test_hyper_p_json_takes_the_device_options():
    from seqshard.app.config import load_config

    option = {
        "large_dataset": True,
        "trset": "x/*.tar",
        "device": "cuda:1",
        "features": "fbank",
        "feature_device": "cuda",
    }
    loaded = load_config({"train": {"option": option}})
    assert (loaded.loader["device"], loaded.loader["feature_device"]) == ("cuda:1", "cuda")
    with pytest.raises(ConfigError, match="device must be None, 'cpu', 'cuda' or 'cuda:N', got 'gpu'"):
        load_config({"train": {"option": {**option, "device": "gpu"}}})
