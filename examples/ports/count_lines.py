"""How many lines each port changed in the script it ports: the table in examples/ports/README.md.

    python examples/ports/count_lines.py

The rule: both files are read as lists of code lines (blank lines and lines holding only a comment
are left out, each line stripped of its indentation and trailing spaces), compared with difflib,
and every line only in the original (removed) or only in the port (added) counts once; a line that
was edited counts twice (removed + added). Indentation is left out because moving a script's
top-level code into a function (as a task function needs) re-indents it without changing it, the
way `git diff -w` shows it; the `strict` columns count re-indented lines too. The expgpu port's
task file (examples/conf/task/<name>.yaml) is new code too: its non-comment lines are added to its
count. The `prints kept` column counts the Fabric port as if its fabric.print (rank 0 prints) were
print() again: every rank printing, as the expgpu ports do unless run with launch.stdout=rank0.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path

PORTS = Path(__file__).resolve().parent
TASKS = PORTS.parent / "conf" / "task"

# name: (the script as published, its Lightning Fabric port, its expgpu port, the expgpu task file)
SCRIPTS = {
    "nanogpt": ("train.py", "fabric_train.py", "expgpu_train.py", "nanogpt.yaml"),
    "word_language_model": ("main.py", "fabric_main.py", "expgpu_main.py", "word_language_model.yaml"),
    "vae": ("main.py", "fabric_main.py", "expgpu_main.py", "vae.yaml"),
    "time_sequence_prediction": ("train.py", "fabric_train.py", "expgpu_train.py", "time_sequence_prediction.yaml"),
}


def code_lines(path: Path, strict: bool = False) -> list[str]:
    """The lines that hold code: no blank or comment-only lines; indentation kept only if strict."""
    out = []
    for line in path.read_text().splitlines():
        text = line.strip()
        if text and not text.startswith("#"):
            out.append(line.rstrip() if strict else text)
    return out


def changed(original: list[str], port: list[str]) -> int:
    """Lines removed from `original` plus lines added in `port`."""
    ops = difflib.SequenceMatcher(None, original, port, autojunk=False).get_opcodes()
    return sum((i2 - i1) + (j2 - j1) for tag, i1, i2, j1, j2 in ops if tag != "equal")


def count(name: str) -> dict[str, int]:
    original, fabric, expgpu, task = SCRIPTS[name]
    here = PORTS / name
    row = {"original": len(code_lines(here / original)), "task_file": len(code_lines(TASKS / task))}
    for label, port in (("fabric", fabric), ("expgpu", expgpu)):
        for strict in (False, True):
            key = f"{label}_strict" if strict else label
            row[key] = changed(code_lines(here / original, strict), code_lines(here / port, strict))
    every_rank = [re.sub(r"^fabric\.print\(", "print(", line) for line in code_lines(here / fabric)]
    row["fabric_prints_kept"] = changed(code_lines(here / original), every_rank)
    row["expgpu_total"] = row["expgpu"] + row["task_file"]
    row["expgpu_total_strict"] = row["expgpu_strict"] + row["task_file"]
    return row


def table() -> str:
    """The markdown table of examples/ports/README.md."""
    head = ("| script | original: code lines | Fabric port: changed | (its prints kept) "
            "| expgpu port: changed + task file | strict, re-indented lines too: Fabric / expgpu |\n"
            "| --- | --- | --- | --- | --- | --- |\n")
    rows = []
    for name, (original, *_rest) in SCRIPTS.items():
        c = count(name)
        rows.append(f"| {name}/{original} | {c['original']} | {c['fabric']} | ({c['fabric_prints_kept']}) | "
                    f"**{c['expgpu_total']}** ({c['expgpu']} + {c['task_file']}) | "
                    f"{c['fabric_strict']} / {c['expgpu_total_strict']} |")
    return head + "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
