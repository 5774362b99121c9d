"""Devices: what memory a device has and a process may use, budgets written as strings, and the model
of PyTorch's CUDA caching allocator."""
