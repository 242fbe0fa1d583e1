"""vLLM with the HurrayConnector, and side by side with the peers that run here.

``make bench-vllm``; ``--only TABLE`` for one table, ``--quick`` for a shorter run.  The
tables live in the package ``benchmarks/vllm_bench/``, one module a table.
"""

from vllm_bench.cli import main

if __name__ == "__main__":
    main()
