"""Shards at a URL: ranged reads with retries, requests watched for stalls, a remote folder's selection, the local cache."""
