"""Small helpers every layer uses: tree walks over ATen arguments, pausing the garbage collector, and
the registry of module caches that ``stagetorch.clear_caches`` empties."""
