"""The knowledge side: a corpus folder read into documents, packed into shards, prefilled into
snapshots (ingest), kept fresh, verified when opened, and cleaned up (upkeep). Needs no decode loop."""
