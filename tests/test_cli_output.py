"""The command's output: a reader that stops early (`seqshard inspect ... | head`) ends it
quietly, as it ends other Unix tools; the length histogram's tick labels stay apart."""

import itertools
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from seqshard.formats.index_entries import length_bin
from seqshard.tools.inspect import length_ticks, plot_lengths

ROOT = Path(__file__).parent.parent


def test_a_closed_pipe_ends_a_command_quietly(packed):
    read, write = os.pipe()
    os.close(read)  # the reader is gone before anything is written, as after `| head -1`
    try:
        done = subprocess.run(
            [sys.executable, "-m", "seqshard", "inspect", str(packed.out), "--json", "--quiet"],
            stdout=write,
            stderr=subprocess.PIPE,
            env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            timeout=60,
        )
    finally:
        os.close(write)
    assert done.returncode == 128 + signal.SIGPIPE
    assert done.stderr == b""  # no BrokenPipeError traceback, no "Exception ignored" at exit


def histogram_summary(low_frames: int, high_frames: int) -> dict:
    """inspect's JSON for utterances spread evenly (on a log scale) from low to high frames."""
    histogram: dict[str, int] = {}
    frames = float(low_frames)
    while frames <= high_frames:
        histogram[str(length_bin(int(frames)))] = histogram.get(str(length_bin(int(frames))), 0) + 3
        frames *= 1.05
    return {"frame_shift_ms": 10.0, "length_hist": histogram, "num_utts": 100, "hours": 0.5}


@pytest.mark.parametrize(("low", "high"), [(30, 700), (35, 600), (150, 900), (8, 40), (5, 30000), (100, 180)])
def test_length_plot_labels_stay_apart(tmp_path, monkeypatch, low, high):
    pytest.importorskip("matplotlib")
    import matplotlib.figure

    labels = []
    save = matplotlib.figure.Figure.savefig

    def save_and_measure(figure, *args, **kwargs):
        save(figure, *args, **kwargs)  # draws the figure: label sizes are known
        axes = figure.axes[0]
        renderer = figure.canvas.get_renderer()
        shown = [t for t in axes.get_xticklabels(which="both") if t.get_text() and t.get_visible()]
        inside = [t for t in shown if axes.get_xlim()[0] <= t.get_position()[0] <= axes.get_xlim()[1]]
        labels.extend(sorted(((t.get_text(), t.get_window_extent(renderer)) for t in inside), key=lambda x: x[1].x0))

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", save_and_measure)
    plot_lengths(histogram_summary(low, high), tmp_path / "lengths.png")
    assert (tmp_path / "lengths.png").stat().st_size > 0
    assert len(labels) >= 2, labels
    gaps = [right.x0 - left.x1 for (_, left), (_, right) in itertools.pairwise(labels)]
    assert min(gaps) >= 8, [text for text, _ in labels]  # 3x10^-1 and 4x10^-1 touched at 0.3-7 s
    assert all("times" not in text and "^" not in text for text, _ in labels), labels  # plain numbers: 0.3, 5


def test_length_ticks_are_round_and_few():
    assert length_ticks(0.3, 7) == pytest.approx([0.3, 0.5, 1, 2, 3, 5])
    assert length_ticks(1.5, 10) == pytest.approx([1.5, 2, 3, 4, 5, 6, 8, 10])
    assert length_ticks(0.01, 300) == pytest.approx([0.01, 0.1, 1, 10, 100])
    assert length_ticks(1.42, 1.48) == pytest.approx([1.4, 1.5])  # within one step: the ends, rounded


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["pack", "--scp", "a.scp", "--text", "t", "--out", "o", "--utts-per-fil", "2"], "--utts-per-fil"),
        (["inspect", "shards", "--jso"], "--jso"),
        (["--verb", "verify", "shards"], "--verb"),
    ],
)
def test_abbreviated_options_are_refused_by_name(argv, named, capsys):
    from seqshard.cli import main

    with pytest.raises(SystemExit) as stopped:
        main(argv)  # `--utts-per-fil 2` packed with 2 utterances per file (argparse's prefix matching)
    assert stopped.value.code == 2
    assert f"error: unrecognized arguments: {named}" in capsys.readouterr().err


def test_every_command_and_the_trainer_take_only_whole_option_names(capsys):
    from seqshard.app.trainer import parse_args
    from seqshard.cli import build_parser

    parser = build_parser()
    commands = re.search(r"\{([\w,-]+)\}", parser.format_usage()).group(1).split(",")
    assert len(commands) > 5 and "pack" in commands
    for argv in (["--hel"], *([command, "--hel"] for command in commands)):  # --help, abbreviated
        with pytest.raises(SystemExit) as stopped:
            parser.parse_args(argv)
        assert stopped.value.code == 2 and capsys.readouterr().out == "", argv  # an error, not the help (exit 0)
    with pytest.raises(SystemExit):
        parse_args(["--conf", "hyper-p.json"])
    assert "unrecognized arguments: --conf" in capsys.readouterr().err


def test_counts_of_one_are_singular(tmp_path, capsys):
    """inspect and verify said "1 shards" (issue 23, item 20)."""
    from conftest import write_kaldi_dir
    from seqshard import pack_data
    from seqshard.cli import main
    from seqshard.errors import counted

    assert [counted(1, "shard"), counted(2, "shard", "is"), counted(0, "entry", "has")] == [
        "1 shard", "2 shards are", "0 entries have"
    ]  # fmt: skip
    data = write_kaldi_dir(tmp_path / "kaldi", speakers=1, per_speaker=1, dim=2)
    pack_data(data.scp, data.text, tmp_path / "one", utts_per_file=10, progress=False)
    assert main(["inspect", str(tmp_path / "one"), "--quiet"]) == 0
    assert main(["verify", str(tmp_path / "one"), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("1 shard, 1 utterance, ") and "checked 1 shard: 0 damaged" in out, out
