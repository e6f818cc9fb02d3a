"""The module map in docs/layout.md names every module of tasks/ and of
flows/, and nothing that is not there: a newcomer finds a stage by its
folder, and a flow, the command line or the run config by its module."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYOUT = REPO / "docs" / "layout.md"


def blocks() -> dict[str, list[str]]:
    """{root: its lines} of the indented trees (`    tasks/`, `    flows/`)."""
    out, root = {}, None
    for line in LAYOUT.read_text().splitlines():
        m = re.match(r"^    (\w+)/\s*$", line)
        if m:
            root = m.group(1)
            out[root] = []
        elif root and line.startswith("      "):
            out[root].append(line)
        else:
            root = None
    return out


def documented_tasks() -> dict[str, set[str]]:
    """{folder: {module.py, sub/, ...}, "": {top-level module.py}} from the
    tasks/ tree: a folder's entry and its continuation lines name its
    modules and sub-packages."""
    tree, folder = {}, None
    for line in blocks()["tasks"]:
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


def actual_tasks() -> dict[str, set[str]]:
    tasks = REPO / "tasks"
    tree = {"": {p.name for p in tasks.glob("*.py") if p.name != "__init__.py"}}
    for pkg in sorted(p for p in tasks.iterdir() if (p / "__init__.py").exists()):
        tree[pkg.name] = {p.name for p in pkg.glob("*.py") if p.name != "__init__.py"}
        tree[pkg.name] |= {f"{p.name}/" for p in pkg.iterdir() if p.is_dir() and p.name != "__pycache__"}
    return tree


def documented_flows() -> set[str]:
    """The modules the flows/ tree names, one an entry."""
    return {m.group(1) for line in blocks()["flows"] if (m := re.match(r"^      (\w+\.py|\w+/)\s", line))}


def actual_flows() -> set[str]:
    flows = REPO / "flows"
    return ({p.name for p in flows.glob("*.py") if p.name != "__init__.py"}
            | {f"{p.name}/" for p in flows.iterdir() if p.is_dir() and p.name != "__pycache__"})


def test_the_layout_names_every_module_of_tasks():
    assert documented_tasks() == actual_tasks()


def test_the_layout_names_every_module_of_flows():
    assert documented_flows() == actual_flows()


def test_the_readme_points_to_the_layout():
    assert "docs/layout.md" in REPO.joinpath("README.md").read_text()


def test_stream_mode_lives_in_its_own_package_of_plain_modules():
    """tasks/stream/ holds the stream rules (the budget, the leases, the
    plan), plain functions without Prefect; the flows only wire them, and
    no module of it outgrows a screenful of concerns."""
    for module in (REPO / "tasks" / "stream").glob("*.py"):
        text = module.read_text()
        assert not re.search(r"^\s*(from|import) (prefect|flows)\b", text, re.M), module
        assert len(text.splitlines()) <= 400, module
    for flow in ("stream.py", "stream_node.py"):
        text = (REPO / "flows" / flow).read_text()
        assert not re.search(r"^from flows\.stream import", text, re.M), flow
        assert not re.search(r"^class \w+\((RuntimeError|Exception)", text, re.M), flow


def test_no_module_under_tasks_imports_prefect_or_flows():
    """tasks/ is plain functions, testable without Prefect; what talks to
    Prefect (child runs, automations, artifacts) lives in flows/. Any
    import, at the top or inside a function (nodes.py had run_deployment
    and the heartbeat automation inside its functions)."""
    found = [f"{m.relative_to(REPO)}:{n}" for m in (REPO / "tasks").rglob("*.py")
             for n, line in enumerate(m.read_text().splitlines(), 1)
             if re.match(r"^\s*(from|import) (prefect|flows)\b", line)]
    assert not found, found


README_MAX_LINES = 300
MODULE_MAX_LINES = 500


def test_the_readme_stays_a_front_door():
    """What it is, the two commands, the DAG, one run file, where each
    topic's page is: reference tables and figures live in docs/."""
    lines = len(REPO.joinpath("README.md").read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines: move reference material to docs/"


def test_no_module_outgrows_one_concern():
    """A module past 500 lines has let a second concern move in: split it
    by concern (docs/layout.md names where each went)."""
    over = {str(m.relative_to(REPO)): n for top in ("tasks", "flows", "tests", "bench", "scripts")
            for m in (REPO / top).rglob("*.py")
            if (n := len(m.read_text().splitlines())) > MODULE_MAX_LINES}
    assert not over, over


def _anchor(heading: str) -> str:
    # GitHub's: lower case, punctuation dropped (not - or _), spaces to -.
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_between_the_readme_and_docs_lands():
    """Moving a section to docs/ must not leave a link pointing at nothing."""
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md":
                headings = re.findall(r"^#+ (.+)$", dest.read_text(), re.M)
                if anchor not in {_anchor(h) for h in headings}:
                    broken.append(f"{page.name}: {target}")
    assert not broken, broken
