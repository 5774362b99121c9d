"""Data parallel over ``torch.distributed``: each process runs its shard of one global batch, exactly."""
