"""Bulk indexing: `ember embed` over files, in parts that a restarted run skips."""
