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
import os
import pathlib
import sys
import tempfile

import pytest
from sybil import Sybil
from sybil.parsers.markdown import ClearNamespaceParser, PythonCodeBlockParser, SkipParser

ROOT = pathlib.Path(__file__).parent


def _setup(namespace):
    import torch

    import stagetorch

    stagetorch.clear_caches()
    namespace["_docs_cwd"] = os.getcwd()
    namespace["_docs_tmp"] = tempfile.TemporaryDirectory(prefix="stagetorch-docs-")
    namespace["_docs_threads"] = torch.get_num_threads()
    os.chdir(namespace["_docs_tmp"].name)
    # tests/support (the seed models some pages name) is importable, as the pages' invisible blocks need.
    sys.path.insert(0, str(ROOT / "tests" / "support"))


def _teardown(namespace):
    import torch

    import stagetorch

    os.chdir(namespace["_docs_cwd"])
    namespace["_docs_tmp"].cleanup()
    torch.set_num_threads(namespace["_docs_threads"])
    stagetorch.clear_caches()
    sys.path.remove(str(ROOT / "tests" / "support"))


pytest_collect_file = Sybil(
    parsers=[
        PythonCodeBlockParser(doctest_optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE),
        SkipParser(),
        ClearNamespaceParser(),
    ],
    patterns=["README.md", "docs/*.md"],
    setup=_setup,
    teardown=_teardown,
).pytest()


def pytest_configure(config):
    # A page's blocks share one namespace, so they must run in one process, in order: under pytest-xdist, each
    # page's items form one group, and `-n auto`'s default distribution ("load") becomes "loadgroup", which
    # hands every group to one worker and the other tests out one by one as "load" does.
    if config.pluginmanager.hasplugin("xdist") and getattr(config.option, "dist", "no") == "load":
        config.option.dist = "loadgroup"


def pytest_collection_modifyitems(config, items):
    if not config.pluginmanager.hasplugin("xdist"):
        return
    for item in items:
        if type(item).__name__ == "SybilItem":
            item.add_marker(pytest.mark.xdist_group(name=f"docs:{item.path.name}"))
