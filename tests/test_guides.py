"""Every guide docs/from-*.md and docs/on-*.md runs as written, so a guide that no longer works fails here.

A guide's ```bash and ```python blocks run in order, from the repository root, in one fresh
Python process per guide (``python tests/test_guides.py docs/from-kaldi.md`` runs one by
hand): python blocks share one namespace, as in one interpreter session; each bash block runs
with ``bash -e`` and what it exports (``export OUT=...``) reaches the later blocks of both
kinds, as in one terminal. Blocks of other languages (```text, ```json) are not run.
``GUIDE_OUT`` is a fresh folder: a guide writes only under it (``export
OUT=${GUIDE_OUT:-guide-out}/NAME``), and a guide that writes into the repository fails. The
venv's ``bin`` comes first on PATH and the repository first on PYTHONPATH, so ``seqshard``
is this checkout's.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GUIDES = sorted([*(ROOT / "docs").glob("from-*.md"), *(ROOT / "docs").glob("on-*.md")])
RUN_LANGUAGES = ("bash", "python")
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
SHELL_STATE = ("PWD", "OLDPWD", "SHLVL", "_", "GUIDE_ENV_DUMP")  # bash's own, not the guide's exports
DUMP_ENV = 'import json, os, sys; json.dump(dict(os.environ), open(sys.argv[1], "w"))'


def guide_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, line of its first code line, code) of each bash and python block, in order."""
    return [
        (match[1], text.count("\n", 0, match.start(2)) + 1, match[2])
        for match in FENCE.finditer(text)
        if match[1] in RUN_LANGUAGES
    ]


def run_bash(code: str, guide: Path, line: int) -> None:
    """Run one bash block; afterwards ``os.environ`` holds what it exported."""
    with tempfile.NamedTemporaryFile(suffix=".env") as dump:
        env = dict(os.environ, GUIDE_ENV_DUMP=dump.name)
        dump_env = f'{shlex.quote(sys.executable)} -c {shlex.quote(DUMP_ENV)} "$GUIDE_ENV_DUMP"'
        done = subprocess.run(["bash", "-e", "-c", f"{code}\n{dump_env}"], cwd=ROOT, env=env)
        if done.returncode:
            raise SystemExit(f"{guide}:{line}: the bash block starting here failed (exit status {done.returncode})")
        exported = json.loads(Path(dump.name).read_text())
    for name in SHELL_STATE:
        exported.pop(name, None)
    os.environ.clear()
    os.environ.update(exported)


def run_guide(guide: Path) -> None:
    """Run the blocks of ``guide`` in order, in this process (the repository root as the
    current folder); a failing block ends it with the guide's file and line."""
    os.chdir(ROOT)
    blocks = guide_blocks(guide.read_text(encoding="utf-8"))
    if not blocks:
        raise SystemExit(f"{guide}: no ```bash or ```python block to run")
    namespace: dict = {"__name__": "__main__"}
    for language, line, code in blocks:
        started = time.perf_counter()
        print(f"--- {guide.name}:{line} ({language})", flush=True)
        if language == "bash":
            run_bash(code, guide, line)
        else:  # line numbers of tracebacks are the guide's
            exec(compile("\n" * (line - 1) + code, str(guide), "exec"), namespace)
        print(f"--- {time.perf_counter() - started:.1f} s", flush=True)


def run_guide_process(guide: Path, out: Path, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``guide`` in a fresh Python process with ``GUIDE_OUT=out``."""
    env = dict(
        os.environ,
        GUIDE_OUT=str(out),
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        PYTHONPATH=os.pathsep.join(filter(None, (str(ROOT / "src"), os.environ.get("PYTHONPATH")))),
    )
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, __file__, str(guide)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def repository_changes() -> str:
    """Modified and untracked files of the checkout (not the ignored ones)."""
    return subprocess.run(
        ["git", "status", "--porcelain", "--untracked-files=all"], cwd=ROOT, capture_output=True, text=True
    ).stdout


if __name__ == "__main__":
    for path in sys.argv[1:]:
        run_guide(Path(path).resolve())
else:
    import pytest

    @pytest.mark.slow
    @pytest.mark.parametrize("guide", GUIDES, ids=[guide.name for guide in GUIDES])
    def test_guide_runs_as_written(guide, tmp_path):
        before = repository_changes()
        done = run_guide_process(guide, tmp_path / "out")
        if done.returncode:
            pytest.fail(f"{guide.name} failed:\n{(done.stdout + done.stderr)[-6000:]}", pytrace=False)
        assert repository_changes() == before, f"{guide.name} wrote into the repository (not under $GUIDE_OUT)"

    def test_every_route_has_a_guide():
        names = {guide.name for guide in GUIDES}
        assert {
            "from-kaldi.md",
            "from-wenet.md",
            "from-webdataset.md",
            "from-lhotse.md",
            "from-fairseq.md",
            "from-nemo.md",
            "from-huggingface.md",
            "from-espnet.md",
        } <= names

    def test_every_package_a_guide_imports_comes_with_what_it_says_to_install():
        """A guide names the extra (`pip install -e ".[NAME]"`) of each package its code imports
        that seqshard itself does not install (issue 23, item 20: webdataset, lhotse)."""
        import ast
        import importlib.metadata

        import tomllib

        project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]

        def distributions(requirements):
            return {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in requirements}

        core = distributions(project["dependencies"])
        extras = {name: distributions(reqs) for name, reqs in project["optional-dependencies"].items()}
        providers = importlib.metadata.packages_distributions()
        for guide in GUIDES:
            text = guide.read_text(encoding="utf-8")
            named = [e for found in re.findall(r'pip install -e "?\.\[([\w,-]+)\]', text) for e in found.split(",")]
            installed = core.union(*(extras[name] for name in named))
            for language, line, code in guide_blocks(text):
                if language != "python":
                    continue
                for node in ast.walk(ast.parse(code)):
                    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
                    if isinstance(node, ast.ImportFrom) and not node.level:
                        names = [node.module]
                    for top in {name.split(".")[0] for name in names} - set(sys.stdlib_module_names) - {"seqshard"}:
                        found = {d.lower() for d in providers.get(top, [top])}
                        assert found & installed, f"{guide.name}:{line} imports {top}, which no extra it names installs"

    def write_guide(tmp_path, text):
        guide = tmp_path / "from-test.md"
        guide.write_text(text)
        return guide

    def test_exports_reach_later_blocks_and_fences_of_other_languages_do_not_run(tmp_path):
        guide = write_guide(
            tmp_path,
            "```bash\nexport OUT=$GUIDE_OUT/t\nmkdir -p $OUT\necho hi > $OUT/a\nNOT_EXPORTED=1\n```\n"
            "```text\nexit 1\n```\n"
            "```python\nimport os\nassert open(os.environ['OUT'] + '/a').read() == 'hi\\n'\n"
            "assert 'NOT_EXPORTED' not in os.environ\nx = 41\n```\n"
            "```python\nassert x == 41\nos.environ['FROM_PYTHON'] = 'yes'\n```\n"
            '```bash\ntest "$FROM_PYTHON" = yes && test -f $OUT/a\n```\n',
        )
        done = run_guide_process(guide, tmp_path / "out")
        assert done.returncode == 0, done.stdout + done.stderr

    def test_a_failing_bash_command_fails_the_guide_naming_its_line(tmp_path):
        guide = write_guide(tmp_path, "# t\n\n```bash\ntrue\nfalse\necho not reached\n```\n")
        done = run_guide_process(guide, tmp_path / "out")
        assert done.returncode != 0
        assert f"{guide}:4: the bash block starting here failed" in done.stderr
        assert "not reached" not in done.stdout

    def test_a_failing_assert_fails_the_guide_with_the_guides_line(tmp_path):
        guide = write_guide(tmp_path, "# t\n\n```python\nx = 1\nassert x == 2, 'counts differ'\n```\n")
        done = run_guide_process(guide, tmp_path / "out")
        assert done.returncode != 0
        assert f'File "{guide}", line 5' in done.stderr and "counts differ" in done.stderr

    def test_a_guide_without_runnable_blocks_fails(tmp_path):
        done = run_guide_process(write_guide(tmp_path, "# t\n\n```text\nseqshard pack\n```\n"), tmp_path / "out")
        assert done.returncode != 0 and "no ```bash or ```python block" in done.stderr
