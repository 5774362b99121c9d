"""Training frameworks on stagetorch: ``stagetorch.integrations.lightning`` and
``stagetorch.integrations.transformers``.

Each submodule imports its framework; this package imports nothing, so ``import stagetorch`` works without
the optional extras (``pip install "stagetorch[lightning]"``, ``"stagetorch[transformers]"``).
"""
