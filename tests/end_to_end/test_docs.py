"""The docs cover the public surface: every public name has an API reference entry."""

from __future__ import annotations

import pathlib
import re

import stagetorch

DOCS = pathlib.Path(__file__).parents[2] / "docs"


def test_every_public_name_is_in_the_api_reference():
    documented = set(re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.M))
    public = {f"stagetorch.{n}" for n in stagetorch.__all__ if n != "ops"}
    public |= {f"stagetorch.ops.{n}" for n in stagetorch.ops.__all__}
    missing = sorted(public - documented)
    assert not missing, f"add these to docs/api.md: {missing}"


def test_the_api_reference_names_only_what_exists():
    for name in re.findall(r"^::: (\S+)$", (DOCS / "api.md").read_text(), re.M):
        obj = stagetorch
        for part in name.split(".")[1:]:
            obj = getattr(obj, part)
