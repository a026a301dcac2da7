"""Small local stand-ins for the data the four ported scripts read, written where each script looks
for it (paths relative to the directory the script runs in). Nothing is downloaded.

    python examples/ports/make_data.py          # into each port's own directory

- nanogpt: data/shakespeare_char/{train.bin,val.bin,meta.pkl} as nanoGPT's prepare.py writes them,
  from Python's own reference documentation (pydoc_data.topics) instead of Shakespeare.
- word_language_model: data/wikitext-2/{train,valid,test}.txt, words of the same documentation.
- vae: ../data/MNIST/raw/*-ubyte, the MNIST file format torchvision reads, holding scikit-learn's
  8x8 digits upsampled to 28x28 (MNIST itself cannot be downloaded here).
- time_sequence_prediction: traindata.pt, written by the script's own generate_sine_wave.py.
"""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

PORTS = Path(__file__).resolve().parent


def _docs(chars: int) -> str:
    from pydoc_data.topics import topics

    return "\n".join(topics[k] for k in sorted(topics))[:chars]


def nanogpt(cwd: Path, chars: int = 200_000) -> None:
    """shakespeare_char's layout: characters as uint16 ids, 90% train, and the vocabulary."""
    out = Path(cwd) / "data" / "shakespeare_char"
    out.mkdir(parents=True, exist_ok=True)
    text = _docs(chars)
    chars_ = sorted(set(text))
    stoi = {c: i for i, c in enumerate(chars_)}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    split = int(0.9 * len(ids))
    ids[:split].tofile(out / "train.bin")
    ids[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(chars_), "itos": dict(enumerate(chars_)), "stoi": stoi}, f)


def word_language_model(cwd: Path, words: int = 8_000) -> None:
    """wikitext-2's layout: one file per split, lines of space-separated words."""
    out = Path(cwd) / "data" / "wikitext-2"
    out.mkdir(parents=True, exist_ok=True)
    lines = [" ".join(line.split()) for line in _docs(words * 8).splitlines() if line.split()]
    sizes = {"train.txt": 0.8, "valid.txt": 0.1, "test.txt": 0.1}
    start = 0
    for name, share in sizes.items():
        end = start + int(share * len(lines))
        (out / name).write_text("\n".join(lines[start:end]) + "\n")
        start = end


def vae(cwd: Path, n_train: int = 1500, n_test: int | None = None) -> None:
    """MNIST's raw files (idx format) under ../data/MNIST/raw, from scikit-learn's 1797 digits:
    the first n_train to train on, the next n_test (default: the rest) to test on."""
    import torch
    from sklearn.datasets import load_digits

    digits = load_digits()
    small = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
    big = torch.nn.functional.interpolate(small, size=(28, 28), mode="bilinear", align_corners=False)
    images = (big.squeeze(1).clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    labels = digits.target.astype(np.uint8)
    raw = Path(cwd).parent / "data" / "MNIST" / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    test_end = None if n_test is None else n_train + n_test
    for prefix, sl in (("train", slice(0, n_train)), ("t10k", slice(n_train, test_end))):
        imgs, labs = images[sl], labels[sl]
        (raw / f"{prefix}-images-idx3-ubyte").write_bytes(struct.pack(">IIII", 2051, len(imgs), 28, 28)
                                                          + imgs.tobytes())
        (raw / f"{prefix}-labels-idx1-ubyte").write_bytes(struct.pack(">II", 2049, len(labs)) + labs.tobytes())


def time_sequence_prediction(cwd: Path, length: int | None = None) -> None:
    """traindata.pt, from the example's own generator (it writes into the directory it runs in);
    `length` shortens its series (L = 1000) for quick runs: an LSTM step per point, in Python."""
    import os

    script = PORTS / "time_sequence_prediction" / "generate_sine_wave.py"
    code = script.read_text()
    if length is not None:
        assert "\nL = 1000\n" in code, "generate_sine_wave.py changed: L = 1000 not found"
        code = code.replace("\nL = 1000\n", f"\nL = {length}\n")
    here = os.getcwd()
    os.chdir(cwd)
    try:
        exec(compile(code, str(script), "exec"), {"__name__": "__main__"})
    finally:
        os.chdir(here)


MAKERS = {"nanogpt": nanogpt, "word_language_model": word_language_model, "vae": vae,
          "time_sequence_prediction": time_sequence_prediction}


if __name__ == "__main__":
    for name, make in MAKERS.items():
        make(PORTS / name)
        print(f"{name}: data written under {PORTS / name}")
