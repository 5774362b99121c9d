"""Vendor kernels' workspace replays: the scratch memory a CPU kernel books inside itself, by
replaying its blocking (oneDNN), behind the registry's workspace slot."""
