"""Shards at a URL: ranged reads with deadlines and retries, a remote folder's selection, the local cache."""
