"""Short Python programs, each run as ``python <argv>`` would run it, in children forked from
one process that has already imported the modules every one of them imports first.

A fresh Python spends ~3 s importing torch and grouped_gemm before a program's own first
line; twenty programs spent a minute on it. Here one process (started with the environment
and working directory given) imports ``preload``, then forks a child per program. The child
starts as ``python <argv>`` does: for ``-c CODE`` the code runs in a fresh ``__main__`` with
'' first on sys.path and sys.argv ``["-c", ...]``; for ``SCRIPT`` the script runs as
``__main__`` (``runpy.run_path``) with its directory first on sys.path and its path in
sys.argv[0]. Its exit status is Python's own (SystemExit's code, 1 and the traceback for an
uncaught exception, after the atexit handlers), it may run ``timeout`` seconds, and its
stdout and stderr go to files. Each child starts from the same parent: nothing of one
program is seen by another.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path

_RUNNER = textwrap.dedent(
    """
    import atexit, json, os, runpy, signal, sys, types
    from pathlib import Path

    spec = json.loads(Path(sys.argv[1]).read_text())
    sys.path[0] = spec["path0"]  # where every program looks first, as `python <argv>` has it
    for module in spec["preload"]:
        __import__(module)

    def status_of(code):  # what Python exits with after SystemExit(code)
        if code is None or isinstance(code, int):
            return code or 0
        print(code, file=sys.stderr)
        return 1

    results = {}
    for name, argv in spec["programs"].items():
        logs = [Path(spec["out"]) / f"{len(results)}.{stream}" for stream in ("stdout", "stderr")]
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            for fd, log in zip((1, 2), logs):
                os.dup2(os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
            signal.alarm(spec["timeout"])
            try:
                if argv[0] == "-c":
                    sys.argv = ["-c", *argv[2:]]
                    main = types.ModuleType("__main__")
                    sys.modules["__main__"] = main
                    exec(compile(argv[1], "<string>", "exec"), main.__dict__)
                else:
                    sys.argv = list(argv)
                    runpy.run_path(argv[0], run_name="__main__")
                status = 0
            except SystemExit as exc:
                status = status_of(exc.code)
            except BaseException:
                sys.excepthook(*sys.exc_info())
                status = 1
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status & 0xFF)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        results[name] = [status, *(log.read_text(errors="replace") for log in logs)]
    Path(spec["out"], "results.json").write_text(json.dumps(results))
    """
)


def run_forked(
    programs: Mapping[str, Sequence[str]],
    preload: Sequence[str],
    *,
    env: Mapping[str, str],
    cwd: Path | str | None = None,
    timeout: int = 120,
) -> dict[str, tuple[int, str, str]]:
    """{name: (exit status, stdout, stderr)} of each program, ``name -> argv`` as given to
    ``python`` (``["-c", code, ...]`` or ``[script, ...]``), in the order given. Every
    program must look first in the same place (all ``-c``, or scripts of one directory)."""
    first = {"" if argv[0] == "-c" else str(Path(argv[0]).resolve().parent) for argv in programs.values()}
    assert len(first) == 1, f"programs that look first in different places: {first}"
    with tempfile.TemporaryDirectory() as out:
        spec = {"path0": first.pop(), "preload": list(preload), "timeout": timeout, "out": out}
        spec["programs"] = {name: list(argv) for name, argv in programs.items()}
        (Path(out) / "spec.json").write_text(json.dumps(spec))
        done = subprocess.run(
            [sys.executable, "-c", _RUNNER, str(Path(out) / "spec.json")],
            capture_output=True,
            text=True,
            env=dict(env),
            cwd=cwd,
            timeout=timeout * len(programs) + 60,
        )
        results = Path(out) / "results.json"
        assert done.returncode == 0 and results.exists(), done.stdout[-2000:] + done.stderr[-2000:]
        return {name: tuple(found) for name, found in json.loads(results.read_text()).items()}
