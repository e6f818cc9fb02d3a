"""The README's Layout section names every module of tasks/, and nothing
that is not there: a newcomer finds a stage by its folder."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def documented() -> dict[str, set[str]]:
    """{folder: {module.py, ...}} from the indented tree in README's Layout."""
    section = REPO.joinpath("README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    tree, folder = {}, None
    for line in section.splitlines():
        m = re.match(r"^      (\w+)/\s+(.*)$", line) or re.match(r"^      (\w+\.py)\s+(.*)$", line)
        if m and m.group(1).endswith(".py"):
            tree.setdefault("", set()).add(m.group(1))
            folder = None
            continue
        if m:
            folder, text = m.group(1), m.group(2)
        elif folder and line.startswith("                 "):
            text = line
        else:
            folder = None
            continue
        tree.setdefault(folder, set()).update(re.findall(r"\b(\w+\.py|\w+/)(?=[\s(),]|$)", text))
    return tree


def actual() -> dict[str, set[str]]:
    tasks = REPO / "tasks"
    tree = {"": {p.name for p in tasks.glob("*.py") if p.name != "__init__.py"}}
    for pkg in sorted(p for p in tasks.iterdir() if (p / "__init__.py").exists()):
        tree[pkg.name] = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
        tree[pkg.name] |= {f"{p.name}/" for p in pkg.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return tree


def test_readme_layout_matches_tasks():
    assert documented() == actual()
