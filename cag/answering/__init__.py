"""Turning a request into work for the decoder: a checked question or conversation (questions, chat),
the snapshots kept loaded (resident), and a sharded corpus's choice of shard (routing, across_shards)."""
