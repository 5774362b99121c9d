"""Staging: the tracer that runs a step on fake tensors and records its ATen calls as a Graph, the
discovery of the state it reads, its source lines, the guards that reuse a staged program, and host reads."""
