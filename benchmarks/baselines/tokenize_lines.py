"""Raw tokenizers ceiling for packing: read files, encode_batch_fast over line batches, write uint16.

The raw-tokenizer baseline docs/benchmarks.md measures `dlm pack` against; deliberately kept simple
and left unoptimised by dlm: it defines the figure.

usage: tokenize_lines.py TOKENIZER_JSON FILE...
"""

import sys
import time

import numpy as np
from tokenizers import Tokenizer

tok = Tokenizer.from_file(sys.argv[1])
t = time.perf_counter()
nbytes = ntok = 0
with open("/tmp/baseline-raw.bin", "wb") as out:
    for path in sys.argv[2:]:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
        nbytes += len(text.encode())
        lines = text.splitlines(keepends=True)
        for i in range(0, len(lines), 4096):
            enc = tok.encode_batch_fast(lines[i : i + 4096], add_special_tokens=False)
            ids = np.fromiter((j for e in enc for j in e.ids), dtype=np.uint16)
            ntok += ids.size
            ids.tofile(out)
dt = time.perf_counter() - t
print(f"{nbytes / dt / 1e6:.2f} MB/s {ntok / dt:.0f} tokens/s bytes={nbytes} tokens={ntok} seconds={dt:.2f}")
