"""Run a Python script or module as ``python`` would, then write the process's own peak RSS.

    python bench/peak.py REPORT SCRIPT [ARG ...]
    python bench/peak.py REPORT -m MODULE [ARG ...]
    python bench/peak.py REPORT -c CODE [ARG ...]

At exit (normal or ``sys.exit``) REPORT receives ``VmHWM`` from ``/proc/self/status`` in kB: the
high-water mark of this process's own memory. A parent cannot get it afterwards: the
``ru_maxrss`` that ``wait4`` returns for a child keeps the RSS the child was forked with (its
parent's pages) across ``exec``, so a 10 MB child of a 300 MB parent reports 311 MB; ``VmHWM``
starts over at ``exec``. Used by :func:`common.run_measured`.
"""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

from common import vm_kb


def main() -> None:
    report, *command = sys.argv[1:]
    try:
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            runpy.run_module(command[1], run_name="__main__", alter_sys=True)
        elif command[0] == "-c":
            sys.argv = ["-c", *command[2:]]
            exec(compile(command[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = command
            sys.path[0] = str(Path(command[0]).resolve().parent)  # as `python SCRIPT` sets it
            runpy.run_path(command[0], run_name="__main__")
    finally:
        Path(report).write_text(str(vm_kb("VmHWM")))


if __name__ == "__main__":
    main()
