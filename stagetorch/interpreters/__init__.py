"""The interpreters: each walks a Graph for one concern and knows nothing of the others: shapes,
FLOPs, batch roles (and the generic batch and shape rules the op tables reuse), memory, eager execution,
chunked execution."""
