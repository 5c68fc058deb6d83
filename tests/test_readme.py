"""The README's quick start: exactly two commands, and CI runs the test one verbatim."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _quick_start_commands() -> list[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_has_two_commands():
    cmds = _quick_start_commands()
    assert len(cmds) == 2 and all("\n" not in c for c in cmds)
    assert "sparse_embed.examples.dlrm" in cmds[0]
    # editable: run from the checkout, Python imports the checkout, which has the compiled kernels only so
    # (with a plain `pip install .` the demo would run on the generic kernel and numpy preprocessing)
    assert "pip install -e ." in cmds[0]
    assert "[test]" in cmds[1] and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _quick_start_commands()[1] in ci
