"""Engine plug-ins built on the adapters: ``vllm`` (the HurrayConnector, importing vLLM)
and ``chunks`` (content-keyed KV chunks and their stores, no engine import)."""
