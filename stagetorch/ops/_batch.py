"""Generic batch rules (elementwise, contraction, reduction, view) that the family tables reuse."""

from __future__ import annotations
