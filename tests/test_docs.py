"""The docs describe the repository as it is: their commands parse, their files and links exist.

Every ``tbp fit -c ...`` command in the README and the guides is parsed by the real CLI
(``--print_config``, nothing is trained); every ``bash scripts/dev.sh X`` names a subcommand the
script has; every config in ``configs/`` is listed in the config tables; every relative link
points at a file.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from lightning_tbp.lightning_cli import run_lightning_cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", ROOT / "configs" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _commands(prefix: str) -> list[tuple[str, str]]:
    """(document, command) for every command starting with ``prefix``, joined over ``\\`` lines."""
    found = []
    for doc in DOCS:
        text = doc.read_text().replace("\\\n", " ")
        for match in re.finditer(rf"{re.escape(prefix)}[^`\n#]*", text):
            found.append((doc.name, " ".join(match.group(0).split())))
    return found


# "configs/X.yaml" is a placeholder in prose; real config names are lower case
FIT_COMMANDS = [(doc, c) for doc, c in _commands("tbp fit -c configs/") if re.match(r"tbp fit -c configs/[a-z]", c)]


def test_the_docs_have_commands_to_check() -> None:
    assert len(FIT_COMMANDS) >= 8
    assert any("finetune_lora.yaml" in command for _, command in FIT_COMMANDS)


@pytest.mark.parametrize(("doc", "command"), FIT_COMMANDS, ids=[f"{d}:{c[:60]}" for d, c in FIT_COMMANDS])
def test_every_fit_command_in_the_docs_parses(doc, command, capsys, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    args = [a for a in shlex.split(command)[1:] if a != "--print_config"]
    with pytest.raises(SystemExit) as exit_info:
        run_lightning_cli([*args, "--print_config"])
    assert exit_info.value.code == 0, f"{doc}: `{command}` does not parse:\n{capsys.readouterr().err[-2000:]}"


def test_every_dev_script_subcommand_in_the_docs_exists() -> None:
    script = (ROOT / "scripts" / "dev.sh").read_text()
    known = set(re.findall(r"^  (\w+)\)", script, flags=re.MULTILINE))
    assert {"main", "test"} <= known
    used = {command.split()[2] for _, command in _commands("bash scripts/dev.sh ") if len(command.split()) > 2}
    assert used and used <= known, used - known


def test_every_config_is_listed_where_the_docs_list_them() -> None:
    configs = {path.name for path in (ROOT / "configs").glob("*.yaml")}
    for table in (ROOT / "configs" / "README.md", ROOT / "docs" / "recipes.md"):
        rows = table.read_text().split("| config |", 1)[1].split("\n\n", 1)[0]  # the table of configs
        listed = set(re.findall(r"^\| `([\w.]+\.yaml)`", rows, flags=re.MULTILINE))
        assert listed == configs, f"{table.name}: missing {configs - listed}, stale {listed - configs}"


def test_every_relative_link_points_at_a_file() -> None:
    broken = []
    for doc in DOCS:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, broken
