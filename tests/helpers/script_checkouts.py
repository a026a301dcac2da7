"""The published scripts of examples/ports/ as a user has them: a checkout (the script with its modules,
linked) and its data, from examples/ports/make_data.py (Python's own documentation, pydoc_data): no
network. The script-task tests run these files as published, with no line changed.

    nanogpt(dir)               dir/{train.py, model.py, configurator.py}, dir/data/shakespeare_char/
                               {train.bin, val.bin, meta.pkl} as nanoGPT's prepare.py writes them
    word_language_model(dir)   dir/{main.py, data.py, model.py}, dir/data/wikitext-2/{train,valid,test}.txt
"""

from __future__ import annotations

import sys
from pathlib import Path

PORTS = Path(__file__).resolve().parents[2] / "examples" / "ports"
sys.path.insert(0, str(PORTS))
import make_data  # noqa: E402


def _link(names: list[str], source: Path, checkout: Path) -> None:
    checkout.mkdir(parents=True, exist_ok=True)
    for name in names:
        (checkout / name).symlink_to(source / name)


def nanogpt(checkout: Path, chars: int = 40_000) -> Path:
    _link(["train.py", "model.py", "configurator.py"], PORTS / "nanogpt", checkout)
    make_data.nanogpt(checkout, chars)
    return checkout


def word_language_model(checkout: Path, words: int = 4_000) -> Path:
    _link(["main.py", "data.py", "model.py"], PORTS / "word_language_model", checkout)
    make_data.word_language_model(checkout, words)
    return checkout
