"""Floor 4: the Hurray interchange protocol, the KV cache server and its client."""
