"""Generic memory rules (workspaces, allocator rounding) that the family tables reuse."""

from __future__ import annotations
