"""The Python blocks of README.md and docs/*.md run as tests, one pytest item per block (Sybil).

A page's blocks run in order in one namespace, as a reader runs them one after another: a block may use what an
earlier block of the same page defined. What a page needs but does not show (a model from tests/support, a
launcher) is in an ``<!-- invisible-code-block: python ... -->`` comment beside the block that uses it; a block
that cannot run here says why in a ``<!-- skip: next "reason" -->`` comment, which pytest reports as the skip's
reason. A block that starts with ``>>>`` is a doctest: its printed output is the page's text, checked (ELLIPSIS
marks what the machine decides, NORMALIZE_WHITESPACE lets a long line wrap).

Each page runs in a fresh temporary working directory (a block that writes ``memory.png`` writes it there) with
stagetorch's caches cleared, so no page sees another's programs.
"""

from __future__ import annotations

import doctest
import logging
import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).parent
PAGES = ["README.md", "docs/*.md"]

try:
    from sybil import Sybil
    from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser
    from sybil.parsers.markdown.lexers import FencedCodeBlockLexer
except ImportError:  # an environment without the [dev] extra (CI's oldest-versions leg runs named test files only)
    Sybil = None


class ScriptParser:
    """A block fenced as ```` ```python title="train.py" ```` is a script the page runs as a program of its own
    (under ``torchrun``, say): it is written to that file in the page's working directory, and the page's next
    (invisible) block runs it and prints what it printed."""

    def __init__(self):
        self.lexer = FencedCodeBlockLexer(language=r'python title="[\w.-]+\.py"', mapping={"language": "arguments", "source": "source"})

    def __call__(self, document):
        for region in self.lexer(document):
            name = str(region.lexemes["arguments"]).split('"')[1]
            region.parsed = (name, str(region.lexemes["source"]))
            region.evaluator = self._write
            yield region

    @staticmethod
    def _write(example):
        name, source = example.parsed
        pathlib.Path(name).write_text(source)

def torchrun(script: str, nproc: int = 2) -> list[str]:
    """Runs ``torchrun --standalone --nproc_per_node=NPROC SCRIPT`` (gloo on the CPU) in the page's working
    directory; returns the lines each rank printed that start with "rank ", rank 0's first, each rank's in order.

    One retry: on the loaded 2-core machines the CI shares, a rank has been seen to abort at exit with
    "terminate called without an active exception" (2 runs of some 15 under pytest, none of 8 outside it); a
    second failure raises with both runs' output."""
    failures = []
    for attempt in range(2):
        logs = pathlib.Path(f"{script}-logs-{attempt}")
        run = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
             "--log-dir", str(logs), "--redirects", "1", script],
            capture_output=True, text=True, timeout=300,
        )
        printed = {log.parent.name: log.read_text().splitlines() for log in logs.rglob("stdout.log")}
        if run.returncode == 0:
            return [line for rank in sorted(printed, key=int) for line in printed[rank] if line.startswith("rank ")]
        failures.append(f"attempt {attempt}: exit status {run.returncode}; printed {printed}\n{run.stderr[-2000:]}")
    raise AssertionError(f"torchrun {script} failed twice:\n" + "\n".join(failures))


def _setup(namespace):
    import torch

    import stagetorch

    stagetorch.clear_caches()
    namespace["torchrun"] = torchrun  # a page's script run as several processes
    namespace["REPO"] = ROOT  # the checkout: an invisible block that runs a script of tools/ finds it there
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_tmp"] = tempfile.TemporaryDirectory(prefix="stagetorch-docs-")
    namespace["_docs_threads"] = torch.get_num_threads()
    # A page may turn the stagetorch logger up to show its plan lines: the tests after it see it as it was.
    namespace["_docs_log_level"] = logging.getLogger("stagetorch").level
    os.chdir(namespace["_docs_tmp"].name)
    # tests/support (the seed models some pages name) is importable, as the pages' invisible blocks need; a
    # script a page runs as a program of its own imports this checkout's stagetorch.
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    namespace["_docs_pythonpath"] = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), namespace["_docs_pythonpath"]]))


def _teardown(namespace):
    import torch

    import stagetorch

    os.chdir(namespace["_docs_cwd"])
    namespace["_docs_tmp"].cleanup()
    torch.set_num_threads(namespace["_docs_threads"])
    logging.getLogger("stagetorch").setLevel(namespace["_docs_log_level"])
    stagetorch.clear_caches()
    sys.path.remove(str(ROOT / "tests" / "support"))
    if namespace["_docs_pythonpath"] is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = namespace["_docs_pythonpath"]


if Sybil is not None:
    pytest_collect_file = Sybil(
        parsers=[
            PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
            ScriptParser(),
            SkipParser(),
            ClearNamespaceParser(),
        ],
        patterns=PAGES,
        setup=_setup,
        teardown=_teardown,
    ).pytest()
else:

    class _NoSybil(pytest.Item):
        def runtest(self):
            raise ImportError(f"{self.path.name}'s Python blocks run under Sybil, which is not installed: "
                              'pip install -e ".[dev]" (or "sybil[pytest]")')

    class _Page(pytest.File):
        def collect(self):
            yield _NoSybil.from_parent(self, name="blocks")

    def pytest_collect_file(file_path, parent):
        if any(file_path.match(str(ROOT / pattern)) for pattern in PAGES):
            return _Page.from_parent(parent, path=file_path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist's default distribution ("load"), a page's blocks go to one worker, in order: they share
    one namespace. Every other test is handed out on its own, as "load" does. (xdist's own "loadgroup" would
    do it with markers, but it renames the items in a way pytest 9 no longer sees.)"""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class PagesTogether(LoadScopeScheduling):
        def _split_scope(self, nodeid):
            path = nodeid.split("::", 1)[0]
            return path if path.endswith(".md") else nodeid

    return PagesTogether(config, log)
