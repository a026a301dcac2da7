"""Every expgpu command line the docs show (README.md, docs/*.md) composes: its overrides are checked
against the config schema as the CLI checks them before any rank starts (keys, types, ranges, group
options, the task's keys against its function, hydra.launcher.* and hydra.sweeper.*), so a renamed key
fails the suite with the page and line that still show the old one. Fast tier: Hydra's compose in this
process, no run."""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path

import pytest
from doc_blocks import MARK, REPO, Block, blocks, config_dirs, expgpu_commands, pages, problem

sys.path.insert(0, str(REPO / "examples"))   # the examples' tasks (my_tasks.gan, ...), as PYTHONPATH=examples


def report(page: Path, root: Path, text: str | None = None) -> list[str]:
    """`page:line: command: what is wrong` for each command of a page that does not compose."""
    page_blocks = blocks(page, text)
    dirs = config_dirs(page_blocks, root)
    found = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")   # Hydra's deprecation notes for submitit_local's schema
        for block in page_blocks:
            for cmd in expgpu_commands(block):
                wrong = problem(cmd, dirs)
                if wrong:
                    found.append(f"{cmd.where()}: {cmd}: {wrong}")
    return found


@pytest.mark.parametrize("page", pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_command_a_page_shows_composes(page, tmp_path):
    wrong = report(page, tmp_path)
    assert not wrong, "\n".join(wrong)


def test_the_docs_show_commands_of_every_kind():
    # The checker finds what it should: if the parsing broke, the test above would pass on nothing.
    cmds = [c for page in pages() for b in blocks(page) for c in expgpu_commands(b)]
    first = {c.words[0] for c in cmds}
    assert len(cmds) >= 50 and {"python", "sbatch", "torchrun", "srun"} <= first, first
    assert any(c.multirun for c in cmds) and any(c.config_dir for c in cmds)


def test_a_renamed_key_is_reported_with_its_page_and_line(tmp_path):
    sample = tmp_path / "sample.md"
    sample.write_text("""# A page

<!-- cpu -->
```bash
python -m expgpu task=b launch.nproc_per_node=2     # fine
python -m expgpu -m hydra/launcher=gpu_pool task=a,b \\
    launch.nproc_per_nod=2                          # renamed: line 7, where the command starts is 6
```

- in a list:

  ```text
  $ sbatch scripts/expgpu.sbatch task=b task.max_stepz=10
  ```

```bash
python -m expgpu -m hydra/sweeper=expgpu_optuna hydra.sweeper.n_trialz=4 'task.optimizer.lr=interval(1e-4,1e-1)'
```
""")
    wrong = report(sample, tmp_path / "dirs")
    assert len(wrong) == 3, wrong
    assert wrong[0].startswith(f"{sample}:6: ") and "launch.nproc_per_nod: unknown key" in wrong[0]
    assert wrong[1].startswith(f"{sample}:13: ") and "did you mean task.max_steps?" in wrong[1]
    assert wrong[2].startswith(f"{sample}:17: ") and "hydra.sweeper.n_trialz: unknown key" in wrong[2]


def test_a_config_file_a_page_shows_is_the_one_its_commands_use(tmp_path):
    # bring-your-script's `my_conf/task/nanogpt.yaml` is a script task: task.args.* are free, task.lr is not
    page = tmp_path / "page.md"
    text = """```yaml
# my_conf/task/tiny.yaml: a script task
script: train.py
args: {lr: 0.1}
```

```bash
python -m expgpu --config-dir my_conf task=tiny task.args.lr=1e-3,1e-2 task.args.new_flag=true
python -m expgpu --config-dir my_conf task=tiny task.lr=1e-3
```
"""
    wrong = report(page, tmp_path / "dirs", text)
    assert len(wrong) == 1 and wrong[0].startswith(f"{page}:9: ") and "did you mean task.args.lr?" in wrong[0], wrong


def test_a_cpu_mark_stands_right_before_a_shell_block():
    for page in pages():
        lines = page.read_text().splitlines()
        marked = [i + 1 for i, line in enumerate(lines) if line.strip() == MARK]
        starts = {b.line - 1: b for b in blocks(page)}    # the fence's own line
        for n in marked:
            block: Block | None = starts.get(n + 1)
            assert block is not None and block.lang in ("bash", "sh", "shell"), \
                f"{page.relative_to(REPO)}:{n}: {MARK} must be the line right before a ```bash block"


def test_the_readme_links_every_docs_page_and_the_site_lists_them():
    readme = (REPO / "README.md").read_text()
    nav = (REPO / "mkdocs.yml").read_text()
    for page in sorted((REPO / "docs").glob("*.md")):
        if page.name != "index.md":
            assert f"(docs/{page.name})" in readme, f"README.md links no docs/{page.name}"
        assert re.search(rf":\s*{re.escape(page.name)}\s*$", nav, re.M), f"mkdocs.yml's nav lacks {page.name}"
