"""The published scripts of tests/scripts/ as a user has them: a checkout (the script with its modules,
linked) and its data, generated from Python's own documentation (pydoc_data): no network.

    nanogpt(dir)               dir/{train.py, model.py, configurator.py}, dir/data/shakespeare_char/
                               {train.bin, val.bin, meta.pkl} as nanoGPT's prepare.py writes them
    word_language_model(dir)   dir/{main.py, data.py, model.py}, dir/data/wikitext-2/{train,valid,test}.txt
"""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np

SCRIPTS = Path(__file__).resolve().parent / "scripts"


def _text(chars: int) -> str:
    from pydoc_data.topics import topics

    text = "\n".join(topics[k] for k in sorted(topics))
    return text[:chars]


def _link(names: list[str], source: Path, checkout: Path) -> None:
    checkout.mkdir(parents=True, exist_ok=True)
    for name in names:
        (checkout / name).symlink_to(source / name)


def nanogpt(checkout: Path, chars: int = 40_000) -> Path:
    _link(["train.py", "model.py", "configurator.py"], SCRIPTS / "nanogpt", checkout)
    data = _text(chars)
    vocab = sorted(set(data))
    stoi = {ch: i for i, ch in enumerate(vocab)}
    ids = np.array([stoi[c] for c in data], dtype=np.uint16)
    split = int(len(ids) * 0.9)
    out = checkout / "data" / "shakespeare_char"
    out.mkdir(parents=True)
    ids[:split].tofile(out / "train.bin")
    ids[split:].tofile(out / "val.bin")
    with open(out / "meta.pkl", "wb") as f:
        pickle.dump({"vocab_size": len(vocab), "itos": dict(enumerate(vocab)), "stoi": stoi}, f)
    return checkout


def word_language_model(checkout: Path, chars: int = 30_000) -> Path:
    _link(["main.py", "data.py", "model.py"], SCRIPTS / "word_language_model", checkout)
    lines = _text(chars).splitlines()
    out = checkout / "data" / "wikitext-2"
    out.mkdir(parents=True)
    n = len(lines)
    for name, part in (("train", lines[: n * 8 // 10]), ("valid", lines[n * 8 // 10: n * 9 // 10]),
                       ("test", lines[n * 9 // 10:])):
        (out / f"{name}.txt").write_text("\n".join(part) + "\n")
    return checkout
