"""A pack on any executor: the same bytes from one process, a pool, an executor that only has
``submit``, a Dask cluster, submitit, Ray and parts of an array job; a failed task costs only
itself; repeated keys are still found and the shuffle still mixes, with many chunks and buckets."""

import concurrent.futures
import multiprocessing as mp
import os
import shutil
import threading
from pathlib import Path

import pytest

from conftest import read_shards, write_kaldi_dir
from seqshard import ShardIndex, pack_data
from seqshard.cli import main
from seqshard.errors import ConfigError, InputError, SeqshardError
from seqshard.prep import bucket_wave, chunks
from seqshard.prep.executors import RayExecutor

COMMON = dict(utts_per_file=7, filter_group=["5:30", "30:60"], progress=False)


@pytest.fixture
def small_waves(monkeypatch):
    """Chunks of ~300 bytes and buckets of ~16 utterances: a corpus of 60 lines runs as many tasks."""
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 300)
    monkeypatch.setattr(bucket_wave, "BUCKET_ROWS", 16)


@pytest.fixture
def corpus(tmp_path_factory):
    return write_kaldi_dir(tmp_path_factory.mktemp("corpus"), speakers=6, per_speaker=10)


def written(folder: Path) -> dict:
    """Every shard's bytes and every group's index entries."""
    shards = {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("data-*.tar"))}
    indexes = {g: [s.to_json() for s in ShardIndex.load(folder / g).shards] for g in ("5_30", "30_60")}
    return {"shards": shards, "indexes": indexes}


class SubmitOnly:
    """An executor that has ``submit`` and nothing else; its futures have only ``result``."""

    class Result:
        def __init__(self, thread: threading.Thread, box: list):
            self._thread, self._box = thread, box

        def result(self):
            self._thread.join()
            if isinstance(self._box[0], BaseException):
                raise self._box[0]
            return self._box[0]

    def __init__(self):
        self.submitted = []

    def submit(self, fn, *args, **kwargs):
        self.submitted.append(fn.__name__)
        box = [None]

        def run():
            try:
                box[0] = fn(*args, **kwargs)
            except BaseException as error:
                box[0] = error

        thread = threading.Thread(target=run)
        thread.start()
        return self.Result(thread, box)


def test_every_executor_writes_the_same_bytes(tmp_path, corpus, small_waves):
    from dask.distributed import Client, LocalCluster
    from submitit import DebugExecutor

    pack_data(corpus.scp, corpus.text, tmp_path / "one", **COMMON)
    reference = written(tmp_path / "one")
    assert len(reference["shards"]) >= 6
    submit_only = SubmitOnly()
    runs = {
        "jobs": dict(jobs=3, max_open=2),
        "processes": dict(executor="processes:2"),
        "pool": dict(executor=concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context("fork"))),
        "submit_only": dict(executor=submit_only),
        "submitit": dict(executor=DebugExecutor(folder=str(tmp_path / "submitit"))),
    }
    for name, options in runs.items():
        report = pack_data(corpus.scp, corpus.text, tmp_path / name, **COMMON, **options)
        assert report.complete and report.packed + sum(report.dropped.values()) == report.input_utts == 60
        assert written(tmp_path / name) == reference, name
    assert {"scan_task", "bucket_task", "write_task"} <= set(submit_only.submitted)
    assert submit_only.submitted.count("scan_task") > 3 and submit_only.submitted.count("bucket_task") > 3
    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True) as cluster, Client(cluster) as client:
        pack_data(corpus.scp, corpus.text, tmp_path / "dask", executor=client.get_executor(), **COMMON)
        argv = ["pack", "--scp", str(corpus.scp), "--text", str(corpus.text), "--out", str(tmp_path / "dask-cli")]
        argv += ["--utts-per-file", "7", "--filter-group", "5:30", "--filter-group", "30:60", "--quiet"]
        address = cluster.scheduler_address.removeprefix("tcp://")
        assert main([*argv, "--executor", f"dask://{address}"]) == 0
    assert written(tmp_path / "dask") == reference
    assert written(tmp_path / "dask-cli") == reference


def test_a_local_dask_cluster_from_the_command_line(tmp_path, corpus, caplog):
    argv = ["pack", "--scp", str(corpus.scp), "--text", str(corpus.text), "--utts-per-file", "7", "--quiet"]
    assert main([*argv, "--out", str(tmp_path / "one")]) == 0
    assert main([*argv, "--out", str(tmp_path / "dask"), "--executor", "dask-local:2"]) == 0
    chatter = [r.getMessage() for r in caplog.records if r.name.startswith("distributed") and r.levelno < 30]
    assert not chatter, chatter  # dask's ~30 INFO lines (its scheduler, nannies, workers) only with --verbose
    one, dask = (sorted((tmp_path / n).glob("data-*.tar")) for n in ("one", "dask"))
    assert [p.read_bytes() for p in one] == [p.read_bytes() for p in dask] and len(one) == 9


class FailsOnce(SubmitOnly):
    """Runs tasks in this process; the ``failing``-th task named ``fails`` raises instead."""

    def __init__(self, fails: str, failing: int):
        super().__init__()
        self.fails, self.failing = fails, failing

    def submit(self, fn, *args, **kwargs):
        if fn.__name__ == self.fails and self.submitted.count(self.fails) == self.failing:
            self.submitted.append(fn.__name__)
            return _Failed()
        return super().submit(fn, *args, **kwargs)


class _Failed:
    def result(self):
        raise RuntimeError("the worker was lost")


@pytest.mark.parametrize("wave", ["scan_task", "bucket_task", "write_task"])
def test_a_failed_task_costs_only_itself(tmp_path, corpus, small_waves, wave):
    pack_data(corpus.scp, corpus.text, tmp_path / "clean", **COMMON, executor=(clean := SubmitOnly()))
    with pytest.raises(SeqshardError, match=r"task of (chunk|bucket|shards?) .* failed .*run the same command again"):
        pack_data(corpus.scp, corpus.text, tmp_path / "out", **COMMON, executor=FailsOnce(wave, 2))
    pack_data(corpus.scp, corpus.text, tmp_path / "out", **COMMON, executor=(rerun := SubmitOnly()))
    assert written(tmp_path / "out") == written(tmp_path / "clean")
    assert len(rerun.submitted) < len(clean.submitted)
    for earlier in ["scan_task", "bucket_task", "write_task"][: ["scan_task", "bucket_task", "write_task"].index(wave)]:
        assert earlier not in rerun.submitted  # every task of the waves before was finished and kept


def _exit_in_worker(*args, **kwargs):
    os._exit(3)


class KillsAWorker:
    """A process pool whose third task's worker dies."""

    def __init__(self):
        self.pool = concurrent.futures.ProcessPoolExecutor(2, mp_context=mp.get_context("fork"))
        self.count = 0

    def submit(self, fn, *args, **kwargs):
        self.count += 1
        return self.pool.submit(_exit_in_worker if self.count == 3 else fn, *args, **kwargs)


def test_a_killed_worker_is_named_and_a_rerun_finishes(tmp_path, corpus, small_waves):
    with pytest.raises(SeqshardError, match=r"the scan task of chunk 2 \(.*feats\.scp, bytes \d+-\d+\) failed"):
        pack_data(corpus.scp, corpus.text, tmp_path / "out", **COMMON, executor=KillsAWorker())
    report = pack_data(corpus.scp, corpus.text, tmp_path / "out", **COMMON)
    pack_data(corpus.scp, corpus.text, tmp_path / "one", **COMMON)
    assert report.complete and written(tmp_path / "out") == written(tmp_path / "one")


def _part(args):
    scp, text, out, part = args
    return pack_data(scp, text, out, num_parts=3, part=part, **COMMON).complete


def test_parts_running_at_once_share_the_work_and_write_the_same_bytes(tmp_path, corpus, small_waves):
    pack_data(corpus.scp, corpus.text, tmp_path / "one", **COMMON)
    with mp.get_context("fork").Pool(3) as pool:
        complete = pool.map(_part, [(corpus.scp, corpus.text, tmp_path / "parts", part) for part in range(3)])
    assert any(complete)
    assert written(tmp_path / "parts") == written(tmp_path / "one")
    assert not list((tmp_path / "parts").rglob("claims/*"))  # every claim was released


def test_repeated_keys_across_files_are_found_in_any_bucket(tmp_path, small_waves):
    first = write_kaldi_dir(tmp_path / "a", speakers=4, per_speaker=10)
    second = write_kaldi_dir(tmp_path / "b", speakers=4, per_speaker=10, prefix="spk", seed=3)
    with pytest.raises(
        InputError, match=r"b/feats\.scp:\d+ .* the key was already given at .*a/feats\.scp:\d+"
    ) as error:
        pack_data([first.scp, second.scp], [first.text], tmp_path / "strict", progress=False)
    assert error.value.reason == "duplicate_key"
    report = pack_data([first.scp, second.scp], [first.text], tmp_path / "skip", skip_bad=True, progress=False)
    assert report.dropped == {"duplicate_key": 40} and report.packed == 40
    found = read_shards(sorted((tmp_path / "skip").glob("data-*.tar")))
    for key, (array, _, _) in found.items():
        assert (array == first.arrays[key]).all()  # the first file's entry is kept


def test_shards_of_a_speaker_sorted_corpus_sample_every_speaker_across_buckets(tmp_path, monkeypatch):
    monkeypatch.setattr(chunks, "CHUNK_BYTES", 2000)  # ~10 chunks of each table
    monkeypatch.setattr(bucket_wave, "BUCKET_ROWS", 64)  # ~10 buckets
    data = write_kaldi_dir(tmp_path / "d", speakers=20, per_speaker=30, dim=2, frames=(2, 4))
    report = pack_data(data.scp, data.text, tmp_path / "out", utts_per_file=60, progress=False)
    assert report.packed == 600
    by_shard: dict[str, list[str]] = {}
    for key, (_, _, shard) in read_shards(sorted((tmp_path / "out").glob("data-*.tar"))).items():
        by_shard.setdefault(shard, []).append(data.speaker_of[key])
    for speakers in by_shard.values():  # 60 draws of 20 speakers: ~19 distinct, none above ~9
        assert len(set(speakers)) >= 14 and max(speakers.count(s) for s in set(speakers)) <= 12, speakers


def test_engines_are_named_and_missing_extras_said_in_one_line(tmp_path, corpus):
    with pytest.raises(ConfigError, match="not an executor; give one of processes:N"):
        pack_data(corpus.scp, corpus.text, tmp_path / "o", executor="sparkle", progress=False)
    with pytest.raises(ConfigError, match="a number of workers from 1 to 1024"):
        pack_data(corpus.scp, corpus.text, tmp_path / "o", executor="processes:zero", progress=False)
    with pytest.raises(ConfigError, match="either jobs or executor"):
        pack_data(corpus.scp, corpus.text, tmp_path / "o", executor="processes:2", jobs=2, progress=False)
    if shutil.which("ray") is None:
        try:
            import ray  # noqa: F401
        except ImportError:
            with pytest.raises(ConfigError, match=r"needs ray: pip install 'seqshard\[ray\]'"):
                pack_data(corpus.scp, corpus.text, tmp_path / "o", executor="ray", progress=False)


def test_ray_writes_the_same_bytes(tmp_path, corpus, small_waves):
    ray = pytest.importorskip("ray")
    pack_data(corpus.scp, corpus.text, tmp_path / "one", **COMMON)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        pack_data(corpus.scp, corpus.text, tmp_path / "ray", executor=RayExecutor(), **COMMON)
    finally:
        ray.shutdown()
    assert written(tmp_path / "ray") == written(tmp_path / "one")
