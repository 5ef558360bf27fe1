"""Where a pack's tasks run: any executor, the engines users already have.

An executor is any object with ``submit(fn, *args, **kwargs)`` that returns something with
``.result()``: ``concurrent.futures`` executors, a ``dask.distributed`` client's
``get_executor()``, submitit's executors (Slurm), and Ray through :class:`RayExecutor`. A task
is a module-level function with small picklable arguments that returns a small record; no task
returns per-utterance data.

On the command line ``--executor`` names one (:func:`open_executor`): ``processes:N``,
``dask://HOST:PORT``, ``dask-local:N``, ``ray``, ``ray://HOST:PORT`` or ``slurm``, with
``--executor-option KEY=VALUE`` for the engine's own settings.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checks import MAX_WORKERS
from ..errors import ConfigError, SeqshardError, option

_LOG = logging.getLogger("seqshard")
_POLL_SECONDS = 0.05


class InlineExecutor:
    """Runs each task when it is submitted, in this process (a pack of one process)."""

    live_progress = True  # a task may be handed a progress callback: it runs here

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        future: Future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as error:  # handed to whoever asks the result, as any executor does
            future.set_exception(error)
        return future


class RayExecutor:
    """Ray through the executor seam: ``submit`` is ``ray.remote(fn).remote(...).future()``;
    ``remote_options`` (``num_cpus``, ``memory``, ...) go to ``ray.remote``."""

    def __init__(self, **remote_options: Any):
        import ray

        self._ray = ray
        self._options = remote_options
        self._remotes: dict[Callable[..., Any], Any] = {}

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Any:
        remote = self._remotes.get(fn)
        if remote is None:
            remote = self._remotes[fn] = (
                self._ray.remote(**self._options)(fn) if self._options else self._ray.remote(fn)
            )
        return remote.remote(*args, **kwargs).future()


@dataclass
class Call:
    """One task to run: ``fn(*args)``, named for messages (which chunk, bucket or shards), and
    ``key``: a short name of it, as its files name it (``c000003``, ``b000012``)."""

    key: str
    name: str
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)


def run_calls(executor: Any, calls: Sequence[Call], wave: str, done: Callable[[Call, Any], None], rerun: str) -> None:
    """Run ``calls`` on ``executor``, handing each result to ``done`` as it comes. A task that
    fails stops the wave: its error (a SeqshardError as it is, anything else named by the
    task), with ``rerun`` saying how to go on."""
    pending = [(call, executor.submit(call.fn, *call.args, **call.kwargs)) for call in calls]
    try:
        while pending:
            ready = [item for item in pending if _finished(item[1])]
            if not ready and all(hasattr(future, "done") for _, future in pending):
                time.sleep(_POLL_SECONDS)
                continue
            for item in ready or pending[:1]:  # a future that cannot say whether it is done: wait for it
                pending.remove(item)
                call, future = item
                try:
                    result = future.result()
                except SeqshardError:
                    raise
                except BaseException as error:  # a worker lost, killed or failing: named by its task
                    raise SeqshardError(
                        f"the {wave} task of {call.name} failed ({type(error).__name__}: {str(error)[:300]}). "
                        f"Finished tasks are kept: {rerun}"
                    ) from error
                done(call, result)
    finally:
        for _, future in pending:
            cancel = getattr(future, "cancel", None)
            if cancel is not None:
                with contextlib.suppress(Exception):
                    cancel()


def _finished(future: Any) -> bool:
    done = getattr(future, "done", None)
    return done is not None and bool(done())


PARENT_WATCH_S = 1.0  # how often a pool worker checks that its driver is alive
_FORMS = "processes:N, dask://HOST:PORT, dask-local:N, ray, ray://HOST:PORT or slurm"


@contextlib.contextmanager
def open_executor(
    spec: str | None, jobs: int = 1, settings: Mapping[str, str] | None = None, folder: Path | None = None
) -> Iterator[Any]:
    """The executor ``spec`` names (None: ``jobs`` processes, or this process for 1), open
    for the block; ``settings`` are the engine's own (``--executor-option``), ``folder`` where
    submitit keeps its logs."""
    settings = dict(settings or {})
    spec = spec or (f"processes:{jobs}" if jobs > 1 else "inline")
    kind, _, rest = spec.partition(":")
    if kind == "inline":
        yield InlineExecutor()
    elif kind == "processes":
        workers = _count(spec, rest)
        with ProcessPoolExecutor(
            workers, mp_context=_context(), initializer=_end_with, initargs=(os.getpid(),)
        ) as pool:
            yield pool
    elif kind == "dask" or kind == "dask-local":
        with _dask(spec, kind, rest, settings) as executor:
            yield executor
    elif kind == "ray":
        with _ray(spec, settings) as executor:
            yield executor
    elif kind == "slurm":
        yield _slurm(settings, folder)
    else:
        raise ConfigError(f"{option('executor', spec)}: not an executor; give one of {_FORMS}.")


def _count(spec: str, text: str) -> int:
    """The number of local workers after ``processes:``/``dask-local:`` (as ``jobs``: 1 to MAX_WORKERS)."""
    if not text.isdigit() or not 1 <= int(text) <= MAX_WORKERS:
        raise ConfigError(
            f"{option('executor', spec)}: expected a number of workers from 1 to {MAX_WORKERS} after ':' ({_FORMS})."
        )
    return int(text)


def _end_with(parent: int) -> None:
    """A pool worker's watch: it ends once the driver that started it is gone, however that
    ended (SIGKILL included). An orphan went on holding the folder's lock, which it inherited,
    and the rerun the README advises was refused, naming the dead driver."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_WATCH_S)
        os._exit(1)

    threading.Thread(target=watch, name="seqshard-parent-watch", daemon=True).start()


def _context() -> Any:
    return mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")


def _needs(module: str, extra: str, spec: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError(
            f"{option('executor', spec)} needs {module.split('.')[0]}: pip install 'seqshard[{extra}]'."
        ) from None


@contextlib.contextmanager
def _dask(spec: str, kind: str, rest: str, settings: dict[str, str]) -> Iterator[Any]:
    distributed = _needs("dask.distributed", "dask", spec)
    if not logging.getLogger().isEnabledFor(logging.INFO):  # dask's own INFO lines only with --verbose
        logging.getLogger("distributed").setLevel(logging.WARNING)
    if kind == "dask-local":
        workers = _count(spec, rest)
        with (
            distributed.LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, **settings) as cluster,
            distributed.Client(cluster) as client,
        ):
            yield client.get_executor()
        return
    address = spec.removeprefix("dask://")
    with distributed.Client(address if "://" in address else f"tcp://{address}", **settings) as client:
        yield client.get_executor()


@contextlib.contextmanager
def _ray(spec: str, settings: dict[str, str]) -> Iterator[Any]:
    ray = _needs("ray", "ray", spec)
    started = not ray.is_initialized()
    if started:
        ray.init(address=None if spec == "ray" else spec, log_to_driver=False)
    try:
        yield RayExecutor(**{k: _value(v) for k, v in settings.items()})
    finally:
        if started:
            ray.shutdown()


def _slurm(settings: dict[str, str], folder: Path | None) -> Any:
    submitit = _needs("submitit", "slurm", "slurm")
    try:
        executor = submitit.AutoExecutor(folder=str(folder or "submitit"), cluster="slurm")
        executor.update_parameters(**{k: _value(v) for k, v in settings.items()})
    except (RuntimeError, ValueError) as error:  # no Slurm here (no srun), or a setting submitit does not take
        raise ConfigError(
            f"{option('executor', 'slurm')}: {str(error).strip()} Run the pack where Slurm's commands are (a login "
            f"node), with settings submitit takes (slurm_partition=..., timeout_min=...); or give another executor "
            f"({_FORMS})."
        ) from None
    return executor


def _value(text: str) -> Any:
    """An engine setting as its type: whole numbers and decimals as numbers, else the text."""
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def parse_settings(items: Sequence[str] | None) -> dict[str, str]:
    """``KEY=VALUE`` settings (``--executor-option``) as a mapping."""
    settings = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"{option('executor_option', item)}: expected KEY=VALUE (e.g. slurm_partition=gpu).")
        settings[key] = value
    return settings
