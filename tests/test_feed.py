"""Keeping a training loop fed (issue 24, items 1-3 and 6): windows read ahead so no batch waits
for a whole window, a stream's first windows are small so its first batch comes early, the next
epoch read ahead by persistent workers, nothing of the loader's running in the training process
between batches, the consumer's waits measured and explained, and num_workers="auto".

Counted in samples read, never in milliseconds."""

from __future__ import annotations

import gc
import json
import logging
import math
import multiprocessing
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_resumes_everywhere, pack_small
from seqshard import make_loader
from seqshard.dist import cores_per_rank
from seqshard.options import Workers
from seqshard.pipeline.rank.auto import choose_workers
from seqshard.pipeline.rank.feed import FeedMeter
from seqshard.pipeline.stages import base
from seqshard.pipeline.stages.base import REPLAY_BATCH, Map, Stage
from seqshard.pipeline.stages.batching import LengthBudget, SortBatch
from seqshard.pipeline.stages.sample import Sample
from seqshard.pipeline.stages.shuffle import WindowShuffle
from seqshard.pipeline.workers import worker
from seqshard.pipeline.workers.recipe import SHUFFLE_GROWTH, SORT_GROWTH
from seqshard.pipeline.workers.runtime import WorkerRuntime
from seqshard.testing import ListSource, worker_setup

STATE_V2 = Path(__file__).parent / "data" / "state-v2"
WINDOWS = dict(sort_window=320, shuffle_window=320)  # large enough for the first ones to be smaller


@pytest.fixture(scope="module")
def five_hundred(tmp_path_factory):
    """500 tiny utterances in 2 shards."""
    return pack_small(
        tmp_path_factory.mktemp("five_hundred"), utts_per_file=250, speakers=10, per_speaker=50, dim=2, frames=(2, 9)
    )


class Counted:
    """A transform that counts the samples it sees (in this process)."""

    def __init__(self):
        self.seen = 0

    def __call__(self, sample):
        self.seen += 1
        return sample


def reads_per_batch(loader, counter):
    """Samples read before the first batch, then between consecutive batches."""
    found, before = [], 0
    for _ in loader:
        found.append(counter.seen - before)
        before = counter.seen
    return found


@pytest.mark.parametrize("stream", [{}, dict(uneven="repeat", epoch_steps=120)], ids=["epoch", "endless"])
def test_the_first_batch_comes_early_and_no_batch_waits_for_a_window(five_hundred, stream):
    """Without growth the first batch needs both windows read (640 samples here) and each
    later window's boundary reads a whole window at once; now the first comes after the first
    small windows and every batch reads about its share of the next window (also inside the
    passes of an endless stream)."""
    counter = Counted()
    loader = make_loader(five_hundred.pattern, batch_size=4, num_workers=0, transforms=[counter], **WINDOWS, **stream)
    reads = reads_per_batch(loader, counter)
    assert sum(reads) == counter.seen and len(reads) >= 120 and counter.seen >= 480
    assert reads[0] <= 200  # shuffle windows of 64 and 64 fill the first sort window of 64
    if not stream:  # grow_windows=False: full windows from the start, as before
        counter = Counted()
        loader = make_loader(
            five_hundred.pattern, batch_size=4, num_workers=0, transforms=[counter], grow_windows=False, **WINDOWS
        )
        assert reads_per_batch(loader, counter)[0] >= 320
    assert max(reads[1:]) <= 100  # a small shuffle window at most, else about a batch's share (never 320)
    assert sorted(reads[1:])[-2] <= 40  # a batch of 4: up to ~4 x 4 while the windows grow


def lengths_only(lengths):
    return [Sample(f"u{i:05d}", {"feats": range(int(n))}) for i, n in enumerate(lengths)]


class Preparing(Stage):
    """Hands out its source's outputs and lets the source read ahead after each, as a reader does
    (``further``: and read on until its next windows are read, as a worker that waits does)."""

    def __init__(self, source, further=False):
        super().__init__(source)
        self.further = further

    def next(self):
        output = self.source.next()
        self.source.prepare()
        if self.further:
            self.source.read_further(math.inf)
        return output


def growing(samples, prepare=True, further=False):
    stage = SortBatch(
        WindowShuffle(ListSource(samples), 300, 7, 1, grow=SHUFFLE_GROWTH),
        400,
        LengthBudget(60),
        7,
        1,
        grow=SORT_GROWTH,
    )
    return Preparing(stage, further) if prepare else stage


@pytest.mark.parametrize("further", [False, True], ids=["its share", "further"])
def test_reading_ahead_changes_no_batch_and_resumes_everywhere(further):
    samples = lengths_only(np.random.default_rng(5).integers(1, 20, 800))
    keys = assert_resumes_everywhere(lambda: growing(samples, further=further), limit=12)
    assert keys == [[s.key for s in b.samples] for b in growing(samples, prepare=False)]
    assert sorted(k for batch in keys for k in batch) == [s.key for s in samples]
    stage = growing(samples, further=further)
    for _ in range(40):
        next(stage)
    sort = stage.source
    held = [s.key for s in sort.pending()]  # taken from the source, not handed out: an elastic resume's
    unprepared = growing(samples, prepare=False)  # the same batches, each window read as the last one runs out
    for _ in range(40):
        next(unprepared)
    waiting = len(unprepared.pending())
    rest = [s.key for b in stage for s in b.samples]
    assert len(set(held)) == len(held) > waiting and set(held) <= set(rest)  # the next window read ahead too


def test_a_state_saved_before_windows_grew_resumes_with_its_windows():
    """tests/data/state-v2: a state seqshard saved at acb907c (version 2) after 7 batches;
    resumed today it gives the batches that version gave after it, though a fresh epoch's
    windows now grow (and give other batches)."""
    expected = json.loads((STATE_V2 / "expected.json").read_text())
    state = json.loads((STATE_V2 / "state.json").read_text())
    pattern = str(STATE_V2 / "shards" / "data-*.tar")
    loader = make_loader(pattern, **expected["options"])
    state["identity"]["shards"] = loader.state_dict()["identity"]["shards"]  # the same shards, in this checkout
    assert state["seqshard_loader_state"] == 2
    loader.load_state_dict(state)
    assert [b["keys"] for b in loader] == expected["rest"]
    fresh = [b["keys"] for b in make_loader(pattern, **expected["options"])]
    assert fresh[: len(expected["head"])] != expected["head"]  # the windows grow now
    elastic = make_loader(pattern, **{**expected["options"], "num_workers": 2})
    elastic.load_state_dict(state, strict=False)
    rest = sorted(k for b in elastic for k in b["keys"])
    assert rest == sorted(k for b in expected["rest"] for k in b)


class Clock:
    """A clock that moves a tick each time it is read."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1
        return self.now


def test_reading_further_keeps_the_sources_next_window_read_in_step(monkeypatch):
    """Reading a sort window on in spare time takes the shuffle's items faster than one a batch;
    the shuffle reads its own next window a share for each of them, so that no item it hands out
    waits for the rest of that window (up to its whole 300 items were read for one before, when
    the spare time ran out before the shuffle's turn to read further)."""
    clock = Clock()
    monkeypatch.setattr(base, "time", clock)  # the spare time: 200 items' reading after each batch
    counter = Counted()
    samples = lengths_only(np.random.default_rng(6).integers(1, 20, 1500))
    shuffle = WindowShuffle(Map(ListSource(samples), counter), 300, 7, 1)
    sort = SortBatch(shuffle, 400, LengthBudget(60), 7, 1)
    most, take = 0, shuffle.next

    def counted_next():
        nonlocal most
        before = counter.seen
        item = take()
        most = max(most, counter.seen - before)
        return item

    shuffle.next = counted_next
    batches = [next(sort)]  # the first windows are read whole, for it
    most = 0
    while True:
        sort.prepare()
        sort.read_further(clock.now + 200)
        try:
            batches.append(sort.next())
        except StopIteration:
            break
    assert sum(map(len, batches)) == 1500
    assert most <= 5, most  # was 298


def read_while_waiting(pattern, in_worker_process):
    """Samples a reader has read by its 10th batch, whose consumer takes one every 20 ms (windows
    of 25 batches, the first of them full)."""
    counter = Counted()
    options = dict(batch_size=4, sort_window=100, shuffle_window=100, grow_windows=False, transforms=[counter])
    setup = worker_setup(make_loader(pattern, num_workers=0, **options))
    run = worker.ReaderRun(setup, WorkerRuntime(None), 0, 0, {"state": None, "seq": 0}, in_worker_process)
    for _ in range(10):
        run.item(run.make(), 0)
        run.prepare()
        time.sleep(0.02)
    return counter.seen


def test_a_worker_reads_the_next_window_while_its_consumer_computes(five_hundred):
    """A reader read the next window a share per batch, so it was read only as the current one
    ran out: any batch slower than the rest at a window's end (a collection, a slow shard)
    left the queue empty. A worker now reads on for half of what it waited between its last
    batches: the next window is read after a few batches of the current one."""
    # shuffle windows of 100 read ahead as the sort windows take them: the first two for the first
    # sort window, then 10 shares of the next ones (each window's reading spread over its outputs
    # but the last 3, whose calls arrange it); waiting, the next sort and shuffle windows whole
    assert read_while_waiting(five_hundred.pattern, False) == 258
    assert read_while_waiting(five_hundred.pattern, True) == 300


def test_a_persistent_worker_reads_the_next_epochs_first_window_in_its_spare_time(five_hundred):
    """A persistent worker made the next epoch's first batches in the time it would wait, one
    batch at a time: the first read the epoch's first windows whole, in one go (a small epoch's
    first window holds a quarter of a full one now). It now reads that window on in spare time,
    a little after each batch once its own reading is done, before it makes those batches; the
    batches are the epoch's as a fresh run makes them."""
    counter = Counted()
    options = dict(batch_size=4, sort_window=400, shuffle_window=100, transforms=[counter], persistent_workers=True)
    setup = worker_setup(make_loader(five_hundred.pattern, num_workers=1, **options))
    runtime = WorkerRuntime(None)
    run = worker.ReaderRun(setup, runtime, 0, 0, {"state": None, "seq": 0}, True)
    batches = 0
    while isinstance(made := run.make(), worker.Made):
        run.item(made, 0)
        run.prepare()
        batches += 1
        time.sleep(0.01)
        if run.reading_done():
            break
    assert batches < 110  # of 125: the epoch's reading, then the next one's first window, done before its end
    before = counter.seen
    ahead = worker.ReaderRun(setup, runtime, 0, 1, {"state": None, "seq": 0}, True)
    first = ahead.make()
    assert counter.seen - before < 20  # its first window was read: a share of the next one at most
    assert "held" in pickle.loads(first.state)  # and its windows are saved with their samples' places
    fresh = worker.ReaderRun(setup, WorkerRuntime(None), 0, 1, {"state": None, "seq": 0})
    made = [first] + [ahead.make() for _ in range(124)]
    keys = [[s.key for s in m.batch.samples] for m in made]
    assert keys == [[s.key for s in fresh.make().batch.samples] for _ in range(125)]


FROZEN = multiprocessing.Value("q", -1)  # gc.get_freeze_count() in a worker process (forked workers share it)


def frozen(sample):
    FROZEN.value = gc.get_freeze_count()
    return sample


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="workers share FROZEN through fork")
def test_a_worker_keeps_its_long_lived_objects_out_of_the_collectors_scans(packed):
    """A full collection of the cyclic garbage collector scanned every object of a worker (torch's
    ~170,000 among them): 60-180 ms, every few windows, long enough to empty the queue of
    batches (waits of 7-18 steps of 10 ms). A worker freezes what lives when its first run
    begins; the training process's own collector is left alone."""
    options = dict(batch_size=2, shuffle_window=12, sort_window=8, transforms=[frozen])
    assert len(list(make_loader(packed.pattern, num_workers=1, **options))) == 24
    assert FROZEN.value > 10_000
    assert len(list(make_loader(packed.pattern, num_workers=0, **options))) == 24
    assert FROZEN.value == gc.get_freeze_count() == 0


TOUCHED = multiprocessing.Value("q", 0)  # samples a worker process has read (forked workers share it)


def touched(sample):
    with TOUCHED.get_lock():
        TOUCHED.value += 1
    return sample


def epoch_keys(loader, epoch):
    loader.set_epoch(epoch)
    return [b["keys"] for b in loader]


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="workers share TOUCHED through fork")
def test_a_persistent_worker_reads_the_next_epoch_before_it_is_asked(packed):
    options = dict(batch_size=2, num_workers=1, seed=4, shuffle_window=12, sort_window=8)
    TOUCHED.value = 0
    loader = make_loader(packed.pattern, persistent_workers=True, transforms=[touched], **options)
    first = epoch_keys(loader, 0)
    assert sum(map(len, first)) == 48
    deadline = time.monotonic() + 60
    while TOUCHED.value <= 48 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert TOUCHED.value > 48  # samples of epoch 1 read while no iteration was asked for
    reference = make_loader(packed.pattern, **options)
    assert epoch_keys(loader, 1) == epoch_keys(reference, 1)  # what it read ahead is epoch 1 as asked
    assert epoch_keys(loader, 5) == epoch_keys(reference, 5)  # read ahead for epoch 2, dropped
    loader.close()


def test_the_training_process_runs_no_thread_of_the_loaders_and_waits_without_spending(packed):
    """With workers, taking a batch is a blocking read of that worker's pipe: no thread (torch's
    DataLoader ran a queue feeder thread per worker) and no CPU while the worker is slow."""
    before = set(threading.enumerate())
    loader = make_loader(
        packed.pattern, batch_size=2, num_workers=1, transforms=[slow], shuffle_window=12, sort_window=8
    )
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in loader:
        assert set(threading.enumerate()) == before
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall > 48 * 0.01 and cpu < 0.5 * wall  # generous: polling would spend the whole wait


def slow(sample):
    time.sleep(0.01)
    return sample


def a_little_slow(sample):
    time.sleep(0.002)
    return sample


def test_the_consumers_waits_are_measured_and_explained_once_an_epoch(packed, caplog):
    options = dict(batch_size=1, num_workers=0, transforms=[a_little_slow], shuffle_window=12, sort_window=8)
    short = make_loader(packed.pattern, **options)
    long = make_loader(packed.pattern, epoch_steps=60, uneven="repeat", **options)
    with caplog.at_level(logging.WARNING, logger="seqshard"):
        assert len(list(short)) == 48 and 0.5 < short.stats()["data_wait"] <= 1.0  # the loop did nothing but wait
        assert not caplog.records  # 48 steps: fewer than the 50 before the waits are judged
        for epoch in range(2):
            long.set_epoch(epoch)
            assert len(list(long)) == 60
    warnings = [r.getMessage() for r in caplog.records if "waited for batches" in r.getMessage()]
    assert len(warnings) == 2 and all("num_workers='auto'" in w for w in warnings)  # one an epoch, naming the fix


@pytest.mark.parametrize(
    ("workers", "waited", "busy", "first", "says"),
    [
        (1, 0.5, 3.0, 0.0, "num_workers=5 or more"),  # a batch takes a worker 30 ms, a step 10 ms: 1.5 x 3
        (2, 0.5, 0.5, 0.4, "persistent_workers=True"),  # keeps up, but the start waited
        (2, 0.5, 0.5, 0.0, "prefetch_factor=8"),
    ],
)
def test_the_advice_names_what_to_change(workers, waited, busy, first, says, monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)  # a machine of 16 cores
    meter = FeedMeter(Workers(num_workers=workers), rank=0)
    meter.steps, meter.waited, meter.busy, meter.first = 100, waited, busy, first
    meter.started = time.perf_counter() - (1.0 + waited)  # 100 steps of 10 ms of the consumer's own
    assert says in meter.advice(meter.share())


def test_auto_workers_follow_the_measure_and_the_cores(monkeypatch):
    assert choose_workers(0.002, spare=15) == 2  # cheap batches: two readers share each epoch's start
    assert choose_workers(0.080, spare=15) == 15  # on-the-fly fbank: every core this rank may use
    assert choose_workers(0.080, spare=1) == 1
    assert choose_workers(None, spare=7) == 2
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cores_per_rank() == 4


def test_auto_workers_are_chosen_once_and_a_state_keeps_its_own(packed, monkeypatch):
    options = dict(batch_size=2, seed=1, shuffle_window=12, sort_window=8)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    auto = make_loader(packed.pattern, num_workers="auto", **options)
    assert auto.options.workers.num_workers == 2  # 3 cores: 2 workers, one core left for training
    one = make_loader(packed.pattern, num_workers=1, **options)
    batches = iter(one)
    for _ in range(5):
        next(batches)
    state = one.state_dict()
    rest = [b["keys"] for b in batches]
    auto.load_state_dict(state)  # saved with 1 worker: the auto loader resumes with 1, exactly
    assert [b["keys"] for b in auto] == rest and auto.options.workers.num_workers == 1
    with pytest.raises(Exception, match="'auto'"):
        make_loader(packed.pattern, num_workers="many", **options)


class KillOnce:
    """A transform whose worker kills itself at utt003, the first time only (a marker file)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __call__(self, sample):
        if sample.key.endswith("utt003") and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return sample


@pytest.mark.parametrize("persistent", [False, True], ids=["workers", "persistent"])
def test_a_worker_killed_is_reported_not_waited_for_and_the_next_epoch_starts_anew(packed, tmp_path, persistent):
    loader = make_loader(
        packed.pattern, batch_size=2, num_workers=1, persistent_workers=persistent,
        transforms=[KillOnce(tmp_path / "killed")], shuffle_window=12, sort_window=8,
    )  # fmt: skip
    with pytest.raises(RuntimeError, match=r"stopped unexpectedly \(killed by signal 9\)"):
        list(loader)
    loader.set_epoch(1)  # a persistent worker that died is replaced (it was a BrokenPipeError)
    assert sorted(key for batch in loader for key in batch["keys"]) == sorted(packed.data.arrays)


def test_a_script_that_never_closes_its_persistent_workers_exits(packed):
    """Workers ignore SIGTERM (a scheduler's signal is their rank's to handle), which
    multiprocessing's exit sends before waiting for them without a limit: they are stopped first."""
    script = (
        "import sys, seqshard\n"
        "loader = seqshard.make_loader(sys.argv[1], batch_size=2, num_workers=2, persistent_workers=True)\n"
        "for batch in loader:\n    pass\n"
        "for batch in loader:\n    break\n"
    )
    done = subprocess.run([sys.executable, "-c", script, packed.pattern], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr


BUILT = multiprocessing.Value("q", 0)  # pipelines built in worker processes


class CountBuilds(Stage):
    """A transform stage that counts the pipelines built with it."""

    def __init__(self, source, reader):
        super().__init__(source)
        with BUILT.get_lock():
            BUILT.value += 1

    def next(self):
        return self.source.next()


@pytest.mark.skipif(multiprocessing.get_start_method() != "fork", reason="workers share BUILT through fork")
def test_a_stream_cut_into_epochs_goes_on_without_reading_its_windows_again(packed):
    """uneven="repeat": an epoch ends at epoch_steps while the worker has made batches ahead;
    a persistent worker sends those again next epoch and goes on with its pipeline where it
    stood (workers that do not persist build it again from the state, reading its windows
    again): the same batches, one pipeline for the four epochs."""
    options = dict(
        batch_size=2, num_workers=1, seed=2, shuffle_window=12, sort_window=8, uneven="repeat", epoch_steps=5
    )
    built, batches = {}, {}
    for persistent in (False, True):
        BUILT.value = 0
        loader = make_loader(packed.pattern, persistent_workers=persistent, transforms=[CountBuilds], **options)
        batches[persistent] = [epoch_keys(loader, epoch) for epoch in range(4)]
        built[persistent] = BUILT.value
        loader.close()
    assert batches[True] == batches[False] and len(batches[True][3]) == 5
    assert built == {False: 4, True: 1}


@pytest.mark.parametrize("values", [["a", "b"], ["a\0x", "b"], [b"x", "y"], [None, "z"], [""], ["", ""], []])
def test_a_batch_crosses_the_pipe_as_it_was(values):
    """Texts travel joined into one string (one to unpickle, not one per sample); anything a
    join would change (a NUL of their own, bytes, None) travels as it is. A message of an
    abandoned iteration still in the pipe is dropped."""
    import multiprocessing

    from seqshard.pipeline.transport.delivery import Arrivals, Inbox
    from seqshard.pipeline.transport.wire import BatchItem, encode

    items, sending = multiprocessing.Pipe(duplex=False)
    credits_in, credits = multiprocessing.Pipe(duplex=False)
    feats = np.arange(6, dtype=np.float32).reshape(2, 3)
    item = BatchItem(0, 1, {"texts": values, "feats": feats}, b"", b"", 2, 4, 6)
    sending.send_bytes(encode(1, item._replace(seq=7)))  # the iteration before
    sending.send_bytes(encode(2, item))
    take = Arrivals(None, pin_memory=False, on_device=False).taker([Inbox(0, items, credits, str)], 2, 0)
    again = take(0)
    assert again.batch["texts"] == values and again.seq == 1 and again.batch["feats"].tolist() == feats.tolist()
    assert os.read(credits_in.fileno(), 16) == b"\1"  # one credit for the item taken


def test_an_epochs_start_neither_walks_the_plan_nor_draws_orders_and_len_still_counts(five_hundred, monkeypatch):
    """Walking a small epoch's planned batches (~40 us an utterance) and drawing orders of its
    lengths for an estimate (tens of ms) are for len() and planned_batches(), never before each
    epoch's first batch in the training process."""
    from seqshard.pipeline.rank import counts

    calls = []

    def counted(name):
        function = getattr(counts, name)
        return lambda *args: calls.append(name) or function(*args)

    for name in ("walked_count", "drawn_counts"):
        monkeypatch.setattr(counts, name, counted(name))
    loader = make_loader(five_hundred.pattern, batch_frames=60, num_workers=0, **WINDOWS)
    batches = sum(1 for _ in loader)
    assert not calls
    loader.set_epoch(0)  # len() after an epoch counts the next one's
    assert len(loader) == batches and calls == ["walked_count"]
    large = make_loader(five_hundred.pattern, batch_frames=60, num_workers=0, sort_window=64, shuffle_window=64)
    monkeypatch.setattr(counts, "EXACT_UTTS", 100)  # too many to walk: bounds drawn over orders of lengths
    sum(1 for _ in large)
    assert calls == ["walked_count"]
    assert not large.planned_batches().exact and "drawn_counts" in calls[1:]


def test_a_batch_from_a_worker_costs_the_training_process_a_few_calls(five_hundred):
    """Taking a worker's batch is one read of its pipe, one unpickling, one credit written back
    and two calls per array of the slot (a numpy array over the slot's lease, its tensor), with
    the merged stream's and the epoch's bookkeeping: a few Python calls, not a chain of takes
    (issue 32, item 4: 55-58 calls a batch before, the loop's own included). Of the transport's
    own Python functions, three a batch: the take, the slot's receive, the lease let go (five
    before: a take handed on through the pool, the link, the slot and the item's making)."""
    calls = 0
    transport: list[str] = []
    folders = tuple(str(Path(worker.__file__).parent.parent / name) for name in ("transport", "workers"))

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")
        if event == "call" and frame.f_code.co_filename.startswith(folders):
            transport.append(frame.f_code.co_name)

    for workers in (1, 2):
        loader = make_loader(five_hundred.pattern, batch_size=4, num_workers=workers, **WINDOWS)
        batches = iter(loader)
        for _ in range(20):
            next(batches)
        calls, transport = 0, []
        sys.setprofile(count)
        for _ in range(60):
            next(batches)
        sys.setprofile(None)
        loader.close()
        assert calls / 60 <= 32, (workers, calls / 60)
        assert len(transport) <= 3 * 60, (workers, sorted(set(transport)))


def slower(sample):
    time.sleep(0.05)
    return sample


def test_a_worker_that_sends_nothing_for_the_timeout_is_named(packed):
    loader = make_loader(
        packed.pattern, batch_size=2, num_workers=1, timeout=0.2, transforms=[slower], shuffle_window=12, sort_window=8
    )
    with pytest.raises(RuntimeError, match=r"worker 0 sent no batch for 0.2 s \(the loader's timeout option\)"):
        next(iter(loader))
    loader.close()


@pytest.mark.parametrize(
    ("stage", "bucket_sync"), [(False, False), (True, False), (False, True)], ids=["function", "stage", "bucket sync"]
)
def test_a_resume_reads_only_the_samples_of_the_batches_it_hands_out(five_hundred, stage, bucket_sync):
    """Issue 32, item 5: a restore read the windows in flight again from their start (a shuffle
    and a sort window of 320 here) before its first batch. Now each window's state holds its
    outputs by their samples' origins and the source's state where it ended: the restored
    windows read again only the samples of the batches they hand out, as they hand them out (at
    least REPLAY_BATCH samples at once), and the batches, their counters and the state after each are those of the uninterrupted
    run (with bucket_sync too: its windows' batches go out in the drawn order, which the record
    keeps). Under a Stage of the user's (which may keep state) the windows are read again."""
    options = dict(batch_size=4, num_workers=0, seed=3, bucket_sync=bucket_sync, **WINDOWS)
    transforms = [CountBuilds] if stage else [Counted()]
    full = make_loader(five_hundred.pattern, transforms=transforms, **options)
    keys = [b["keys"] for b in full]
    restored = 0
    for k in (1, 39, 40, 41, 79, 80, 81, 97, len(keys) - 1):
        loader = make_loader(five_hundred.pattern, transforms=transforms, **options)
        batches = iter(loader)
        for _ in range(k):
            next(batches)
        state = json.loads(json.dumps(loader.state_dict()))
        loader.close()
        counter = Counted()
        again = make_loader(five_hundred.pattern, transforms=[CountBuilds] if stage else [counter], **options)
        again.load_state_dict(state)
        rest = iter(again)
        first = next(rest)["keys"]
        if not stage and inside(state):  # the first batch's samples (and a few next ones'), not its windows'
            assert len(first) <= counter.seen <= REPLAY_BATCH, (k, counter.seen)
            restored += 1
        assert [first, *(b["keys"] for b in rest)] == keys[k:], k
        assert again.stats()["utts"] == full.stats()["utts"] and again.stats()["steps"] == len(keys)
    assert stage or restored >= 5


def inside(state: dict) -> bool:
    """Whether the sort window of a one-reader state has outputs left (else the next window is
    read, as the uninterrupted run reads it)."""
    from seqshard.pipeline.stages.held import Held

    window = state["ranks"]["0"]["workers"][0]["state"]
    return Held.of(window["held"]).outputs > window["emitted"]


@pytest.mark.parametrize("bucket_sync", [False, True], ids=["plain", "bucket sync"])
def test_a_version_4_state_without_window_records_resumes_by_reading_its_windows_again(five_hundred, bucket_sync):
    """A state saved before version 5 holds no window records (``stages/held.py``): it is read,
    its windows read again from their start, and the batches are those of the uninterrupted run;
    a state of a version this seqshard does not know is refused by name."""
    from seqshard.errors import StateMismatchError
    from seqshard.pipeline.stages.held import without_held

    counter = Counted()
    options = dict(batch_size=4, num_workers=0, seed=3, bucket_sync=bucket_sync, transforms=[counter], **WINDOWS)
    keys = [b["keys"] for b in make_loader(five_hundred.pattern, **options)]
    loader = make_loader(five_hundred.pattern, **options)
    batches = iter(loader)
    for _ in range(50):
        next(batches)
    state = json.loads(json.dumps(loader.state_dict()))
    loader.close()
    assert state["seqshard_loader_state"] == 5 and "held" in state["ranks"]["0"]["workers"][0]["state"]
    old = json.loads(json.dumps({**state, "seqshard_loader_state": 4}))
    for spot in old["ranks"]["0"]["workers"]:
        spot["state"] = without_held(spot["state"])  # as version 4 saved it
    assert not any('"held"' in json.dumps(spot["state"]) for spot in old["ranks"]["0"]["workers"])
    again = make_loader(five_hundred.pattern, **options)
    again.load_state_dict(old)
    counter.seen = 0
    rest = iter(again)
    first = next(rest)["keys"]
    assert counter.seen > REPLAY_BATCH  # its window read again from its start, not its first batch's samples
    assert [first, *(b["keys"] for b in rest)] == keys[50:]
    with pytest.raises(StateMismatchError, match=r"it is version 6, this seqshard reads 2 and 3 and 4 and 5"):
        make_loader(five_hundred.pattern, **options).load_state_dict({**state, "seqshard_loader_state": 6})


def test_workers_start_restoring_at_load_state_dict_and_another_start_is_still_honoured(five_hundred):
    """The workers of a loaded position start, and restore it, while the caller goes on (a
    model loaded); an iteration that starts elsewhere (set_epoch) sends them there instead."""
    options = dict(batch_size=4, num_workers=2, seed=3, **WINDOWS)
    loader = make_loader(five_hundred.pattern, **options)
    batches = iter(loader)
    for _ in range(30):
        next(batches)
    state = json.loads(json.dumps(loader.state_dict()))
    rest = [b["keys"] for b in batches]
    loader.close()
    before = len(multiprocessing.active_children())
    again = make_loader(five_hundred.pattern, **options)
    again.load_state_dict(state)
    assert len(multiprocessing.active_children()) == before + 2  # started before any iteration
    assert [b["keys"] for b in again] == rest
    elsewhere = make_loader(five_hundred.pattern, **options)
    elsewhere.load_state_dict(state)
    assert epoch_keys(elsewhere, 4) == epoch_keys(make_loader(five_hundred.pattern, **options), 4)
    for made in (again, elsewhere):
        made.close()


def test_a_sample_read_in_one_process_costs_fewer_calls(five_hundred):
    """A one-process epoch's work per sample (reading, decoding, windows, batching, collating
    and handing over, counted in Python calls): issue 32, item 8 (111 calls a sample before)."""
    calls = 0

    def count(frame, event, arg):
        nonlocal calls
        calls += event in ("call", "c_call")

    loader = make_loader(five_hundred.pattern, batch_frames=60, num_workers=0, **WINDOWS)
    list(loader)  # the second epoch: nothing left to import or set up
    sys.setprofile(count)
    samples = sum(len(batch["keys"]) for batch in loader)
    sys.setprofile(None)
    assert samples == 500 and calls / samples <= 100, calls / samples


def test_the_wait_advice_never_asks_for_more_workers_than_the_rank_has_cores(monkeypatch):
    """On a 2-core machine the advice asked for num_workers=14: more workers than cores."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    meter = FeedMeter(Workers(num_workers=1), rank=0)
    meter.steps, meter.waited, meter.busy = 100, 0.5, 3.0  # a batch takes a worker 30 ms, a step 10 ms: 5 workers
    meter.started = time.perf_counter() - 1.5
    advice = meter.advice(meter.share())
    assert "more than the 2 cores this rank may use" in advice and "num_workers=" not in advice, advice
