"""Running staged programs: :class:`Executable` runs a plan on real inputs (and recovers from an
out-of-memory error); :class:`Staged` is what ``jit`` returns, with its cache of programs and guards; ``grads`` leaves each
``.grad`` as the eager step would."""
