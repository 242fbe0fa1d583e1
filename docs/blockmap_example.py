"""The snapshot behind the README's `inspect` output and `docs/blockmap.svg`: an engine's
whole page pool (4096 pages of 16 tokens, 2 layers, 8 KV heads x 128, bfloat16) saved for 6
requests that share a 3-page system prompt.  Run: python docs/blockmap_example.py OUT.hrry"""

import sys

import ml_dtypes
import numpy as np

import hurraykv as hk

rng = np.random.default_rng(1)
pools = [np.zeros((4096, 16, 8, 128), ml_dtypes.bfloat16) for _ in range(4)]
prefix, free = [5, 9, 2], list(rng.permutation(np.arange(20, 4096))[:200])
table, seq_ptr, seq_lens = [], [0], []
for _ in range(6):
    n = int(rng.integers(60, 250))
    table += prefix + [int(free.pop()) for _ in range(-(-n // 16) - 3)]
    seq_ptr.append(len(table))
    seq_lens.append(n)
for pool in pools:  # keys and values only where a request wrote them
    pool[table] = rng.standard_normal((len(table), 16, 8, 128)).astype(ml_dtypes.bfloat16)
snap = hk.KVCacheSnapshot.from_arrays(pools[:2], pools[2:], table, seq_ptr, seq_lens,
                                      model="llama-3-8b", metadata={"engine": "vllm"})
hk.save_snapshot(snap, sys.argv[1] if len(sys.argv) > 1 else "example.hrry", fsync=False)
