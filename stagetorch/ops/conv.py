"""Rules for the conv op family."""

from __future__ import annotations

import torch

aten = torch.ops.aten

SHAPE: dict = {}

MEMORY: dict = {}

BATCH: dict = {}
