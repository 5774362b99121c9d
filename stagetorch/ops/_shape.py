"""Generic shape rules (broadcasting, reductions, contractions, views) that the family tables reuse."""

from __future__ import annotations
