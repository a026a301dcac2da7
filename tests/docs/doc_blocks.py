"""The shell blocks of the docs (README.md, docs/*.md), the expgpu commands in them, and each command's
overrides checked against the config schema, so that the docs cannot drift from the code.

A block the suite runs on a CPU is marked by an HTML comment on the line before its fence, invisible on
GitHub and in the mkdocs site alike:

    <!-- cpu -->
    ```bash
    python -m expgpu task=a launch.nproc_per_node=2
    ```

Every other shell block (SLURM, GPUs, a server that never ends) is not run, but its commands' overrides
are checked all the same: `python -m expgpu ...` (also after torchrun, srun, salloc), the `expgpu`
console script, `sbatch ... scripts/expgpu.sbatch ...` and `make run ARGS="..."`; in a `text` block,
the lines that start with a `$ ` prompt."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
MARK = "<!-- cpu -->"
SHELLS = {"bash", "sh", "shell", "console", "text"}   # text: only its `$ ` lines are commands
# --config-dir names the docs use for "a directory of your own", and the one of this checkout that holds
# tasks of those names (gan, charlm, ...): their keys are checked against it. A page's yaml block that
# starts with a `# <dir>/<group>/<name>.yaml` comment is that file, and wins (tests/docs/test_doc_overrides.py).
STAND_IN_DIRS = {"my_conf": "examples/conf"}
# Hydra's optuna sweeper cannot be installed beside optuna>=5; expgpu's takes the same keys and groups.
STAND_IN_OVERRIDES = {"hydra/sweeper=optuna": "hydra/sweeper=expgpu_optuna"}


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


@dataclass(frozen=True)
class Block:
    page: Path
    line: int          # the 1-based line of the block's first line, after its fence
    lang: str
    text: str
    cpu: bool          # marked to run on a CPU

    def where(self, offset: int = 0) -> str:
        return f"{self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page}:{self.line + offset}"


def blocks(page: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a markdown page (indented ones too, as in a list item)."""
    lines = (page.read_text() if text is None else text).splitlines()
    found, i = [], 0
    while i < len(lines):
        m = re.match(r"^(\s*)(`{3,})\s*([\w-]*)", lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence), len(lines))
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1:end])
        cpu = i > 0 and lines[i - 1].strip() == MARK
        found.append(Block(page, i + 2, lang.lower(), body, cpu))
        i = end + 1
    return found


# -- a little of the shell's grammar: words (quotes, backslashes, comments) and the operators between
# commands. Enough for the docs' one-liners; no expansions.

@dataclass
class Simple:
    """One simple command: its words, the line it starts on (in the block), and where its last word ends
    in the block's text (where an argument can be appended)."""
    words: list[str]
    line: int
    end: int


OPERATORS = ("&&", "||", ";", "&", "|", "\n")


def commands(text: str) -> list[Simple]:
    found, words, word, start_line, end, line = [], [], None, 0, 0, 0
    i = 0

    def close():
        nonlocal words, word
        if word is not None:
            words.append(word)
            word = None
        if words:
            found.append(Simple(words, start_line, end))
        words = []

    while i < len(text):
        c = text[i]
        if c == "\\" and text[i + 1:i + 2] == "\n":        # a continued line
            i, line = i + 2, line + 1
            continue
        if c in " \t":
            if word is not None:
                words.append(word)
                word = None
            i += 1
            continue
        if c == "#" and word is None:                       # a comment, to the end of the line
            while i < len(text) and text[i] != "\n":
                i += 1
            continue
        op = next((o for o in OPERATORS if text.startswith(o, i)), None)
        if op:
            close()
            i += len(op)
            line += op == "\n"
            continue
        if word is None:
            word, start_line = "", start_line if words else line
        if c in "'\"":
            close_at = text.find(c, i + 1)
            close_at = len(text) if close_at < 0 else close_at
            word += text[i + 1:close_at]
            i = close_at + 1
        elif c == "\\":
            word += text[i + 1]
            i += 2
        else:
            word += c
            i += 1
        end = i
    close()
    return found


def shell_text(block: Block) -> str:
    """The block as the shell would read it: a text block's `$ ` lines only (the rest is output);
    prompts dropped, line numbers kept."""
    lines = block.text.splitlines()
    if block.lang == "text":
        return "\n".join(line[2:] if line.startswith("$ ") else "" for line in lines)
    return "\n".join(line[2:] if line.startswith("$ ") else line for line in lines)


@dataclass
class ExpgpuCommand:
    """A command line that composes expgpu's config: its overrides and the Hydra flags that matter."""
    block: Block
    simple: Simple
    overrides: list[str]
    config_dir: str | None = None
    multirun: bool = False
    words: list[str] = field(default_factory=list)

    def where(self) -> str:
        return self.block.where(self.simple.line)

    def __str__(self) -> str:
        return " ".join(self.simple.words)


def _is_env(word: str) -> bool:
    return re.match(r"^[A-Z_][A-Z0-9_]*=", word) is not None


def expgpu_args(words: list[str]) -> list[str] | None:
    """The arguments a command line gives expgpu's Hydra app, or None when it runs no expgpu config."""
    while words and _is_env(words[0]):
        words = words[1:]
    if not words:
        return None
    for i in range(len(words) - 1):   # python -m expgpu, torchrun ... -m expgpu, srun ... python -m expgpu
        if words[i] == "-m" and words[i + 1] == "expgpu":
            return words[i + 2:]
    if words[0] == "expgpu":
        return None if words[1:2] == ["status"] else words[1:]
    if words[0] == "sbatch":
        at = next((i for i, w in enumerate(words) if w.endswith("expgpu.sbatch")), None)
        return None if at is None else words[at + 1:]
    if words[0] == "make" and "run" in words:
        args = next((w[len("ARGS="):] for w in words if w.startswith("ARGS=")), "")
        return ["task=a", "gpu_map=ranked", *[w for s in commands(args) for w in s.words]]
    return None


def expgpu_commands(block: Block) -> list[ExpgpuCommand]:
    if block.lang not in SHELLS:
        return []
    found = []
    for simple in commands(shell_text(block)):
        args = expgpu_args(simple.words)
        if args is None:
            continue
        cmd = ExpgpuCommand(block, simple, [], words=simple.words)
        it = iter(args)
        for word in it:
            if word in ("-m", "--multirun"):
                cmd.multirun = True
            elif word in ("--config-dir", "-cd"):
                cmd.config_dir = next(it)
            elif word.startswith("--config-dir="):
                cmd.config_dir = word.split("=", 1)[1]
            elif word == "...":          # "and the rest as above"
                continue
            elif word.startswith("-") and not word.startswith("--") and "=" not in word:
                continue                  # another Hydra flag (-c job, ...)
            elif word.startswith("--"):
                continue
            else:
                cmd.overrides.append(word)
        found.append(cmd)
    return found


# -- checking a command's overrides against the schema, as `python -m expgpu` would before it runs

def config_dirs(page_blocks: list[Block], root: Path) -> dict[str, Path]:
    """The config files a page shows as yaml blocks that start with `# <dir>/<group>/<name>.yaml`,
    written under `root`: {dir: where it now is}."""
    dirs = {}
    for block in page_blocks:
        m = re.match(r"#\s*([\w.-]+)/([\w/.-]+\.yaml)\b", block.text)
        if block.lang in ("yaml", "yml") and m:
            path = root / m.group(1) / m.group(2)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(block.text)
            dirs[m.group(1)] = root / m.group(1)
    return dirs


def samples(overrides: list[str]) -> list[list[str]]:
    """Override lists to compose for a sweep's overrides: all first values, then once per other value
    of each swept key (a group sweep task=a,b,digits has each option checked). A searched range,
    interval(a,b), is composed at its lower end."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.core.override_parser.types import ChoiceSweep, IntervalSweep, RangeSweep

    parsed = OverridesParser.create().parse_overrides([STAND_IN_OVERRIDES.get(o, o) for o in overrides])
    options = []
    for o in parsed:
        if not o.is_sweep_override():
            options.append([o.input_line])
            continue
        key, value = o.get_key_element(), o.value()
        if isinstance(value, ChoiceSweep):
            values = list(o.sweep_string_iterator())
        elif isinstance(value, RangeSweep):
            values = [str(value.start)]
        elif isinstance(value, IntervalSweep):
            start = value.start
            values = [str(int(start) if "int" in (value.tags or ()) or float(start).is_integer() else start)]
        else:
            values = list(o.sweep_string_iterator())
        options.append([f"{key}={v}" for v in values])
    first = [o[0] for o in options]
    lists = [first]
    for i, values in enumerate(options):
        lists += [first[:i] + [v] + first[i + 1:] for v in values[1:]]
    return lists


def composed(overrides: list[str], config_dir: Path | None):
    """The config (with Hydra's own node, so hydra.launcher.* and hydra.sweeper.* are checked too)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    from expgpu import rundir, schema
    from expgpu.__main__ import conf_dir

    schema.register()
    rundir.register()
    GlobalHydra.instance().clear()
    search = [f"hydra.searchpath=[file://{config_dir}]"] if config_dir else []
    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return compose("config", overrides=search + overrides, return_hydra_config=True)


def checked(overrides: list[str], config_dir: Path | None) -> dict:
    """The plain config of these overrides, checked as the CLI checks it before any rank starts (the
    schema, the ranges, the task's keys against its function or a script task's keys); raises otherwise."""
    from omegaconf import OmegaConf, open_dict

    from expgpu import config, task
    from expgpu.pool.job_config import in_job
    from expgpu.script import spec

    composed_cfg = composed(overrides, config_dir)
    with open_dict(composed_cfg):
        composed_cfg.hydra.job.num = 0   # a sweep's first job, for a ${hydra:job.num} in the config
    # without its hydra node (composed for its checks; resolving it needs a running job), whose values a
    # ${hydra:...} still reads as the job will (expgpu.pool.job_config)
    cfg = OmegaConf.masked_copy(composed_cfg, [k for k in composed_cfg if k != "hydra"])
    config.check(cfg)
    plain = in_job(composed_cfg, lambda _: config.plain(cfg))
    if spec.is_script(plain["task"]):
        spec._check_keys(plain["task"])
    else:
        task.resolve(plain["task"])
    return plain


def problem(cmd: ExpgpuCommand, dirs: dict[str, Path]) -> str | None:
    """What is wrong with a command's overrides, in the CLI's one line; None when they compose."""
    from expgpu.__main__ import _one_line
    from expgpu.errors import UserError

    config_dir = None
    if cmd.config_dir:
        config_dir = dirs.get(cmd.config_dir) or REPO / STAND_IN_DIRS.get(cmd.config_dir, cmd.config_dir)
        if not config_dir.is_dir():
            return f"--config-dir {cmd.config_dir}: no such directory in the checkout (or STAND_IN_DIRS)"
    # A value written as a placeholder (`'inventory.simulate=[<4 x A100>]'` in a transcript): only its key is checked.
    shown = [o for o in cmd.overrides if re.search(r"=.*<[^>]+>", o)]
    overrides = [o for o in cmd.overrides if o not in shown]
    for overrides in samples(overrides):
        try:
            plain = checked(overrides, config_dir)
            for o in shown:
                key = o.split("=", 1)[0].lstrip("+~")
                if not _has(plain, key):
                    return f"{key}: unknown key (shown with a placeholder value: {o})"
        except UserError as e:
            return str(e)
        except Exception as e:   # Hydra's and OmegaConf's, as the CLI turns them into one line
            return _one_line(e) or f"{type(e).__name__}: {e}"
    return None


def _has(plain: dict, key: str) -> bool:
    node = plain
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True
