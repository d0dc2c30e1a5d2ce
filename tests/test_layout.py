"""docs/design.md's layers as folders: each family of ``dflash/`` imports only the core, itself and
the families below it that the design names, so a stage never reaches up into a later one (nor
into the plan or the report, which read them all)."""
import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "dflash"

# What each family may import besides the core and itself; the order is the pipeline's.
ALLOWED = {
    "core": set(),
    "prompts": set(),
    "target": set(),
    "generate": {"prompts", "target"},
    "validate": set(),
    "tokenize": set(),
    "hidden": {"target"},
    "train": {"target", "hidden"},
    "eval": {"target", "generate", "hidden", "train"},
    "serve": set(),
    "plan": {"prompts", "target", "generate", "validate", "tokenize", "hidden", "train", "eval", "serve"},
    "report": {"prompts", "target", "generate", "validate", "tokenize", "hidden", "train", "eval", "serve", "plan"},
    "inspect": set(),
}


def imported_families(path: Path) -> dict[str, int]:
    """The ``dflash`` families a module imports, at the top or inside a function, by first line."""
    found: dict[str, int] = {}
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("dflash."):
            names = [node.module.split(".")[1]]
        elif isinstance(node, ast.ImportFrom) and node.module == "dflash":
            names = [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name.split(".")[1] for a in node.names if a.name.startswith("dflash.")]
        else:
            continue
        for name in names:
            found.setdefault(name, node.lineno)
    return found


def test_the_package_is_the_families_of_the_design():
    """Every module sits in a family (the CLI, an adapter, beside them), and every family has a
    docstring that says what lives there and nothing else in its ``__init__``."""
    families = {p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()}
    assert families == set(ALLOWED)
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == ["__init__.py", "cli.py"]
    for family in families:
        tree = ast.parse((PACKAGE / family / "__init__.py").read_text(encoding="utf-8"))
        assert ast.get_docstring(tree) and len(tree.body) == 1, family
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    layers = design[design.index("## Layers"):]
    assert [f for f in ALLOWED if f"`dflash/{f}/`" not in layers] == []


def test_no_family_imports_one_the_design_does_not_allow():
    """The import-graph test: a module importing from a family above its own (or the core
    importing any stage) fails here with the file, line and the family it reached."""
    wrong = []
    for family, allowed in ALLOWED.items():
        for path in sorted((PACKAGE / family).rglob("*.py")):
            for name, line in imported_families(path).items():
                if name not in allowed | {"core", family}:
                    wrong.append(f"{path.relative_to(ROOT)}:{line} imports dflash.{name}")
    assert wrong == []


def test_the_design_states_the_same_rule():
    """docs/design.md's table of families says, for each, what it may import: the test's rule."""
    design = (ROOT / "docs" / "design.md").read_text(encoding="utf-8")
    rows = dict(re.findall(r"^\| `dflash/(\w+)/` \| [^|]* \| ([^|]*) \|$", design, re.M))
    assert set(rows) == set(ALLOWED)
    for family, allowed in ALLOWED.items():
        assert set(re.findall(r"`(\w+)`", rows[family])) == allowed, family


def test_an_import_inside_a_function_says_why():
    """A module's imports sit at its top, so its import block says what it depends on; one inside a
    function (torch or transformers, heavy for a command that needs neither; an optional tracker)
    says why on its line."""
    silent = []
    for path in sorted(PACKAGE.rglob("*.py")):
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            for inner in ast.walk(node) if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) else ():
                if isinstance(inner, (ast.Import, ast.ImportFrom)) and "#" not in lines[inner.lineno - 1]:
                    silent.append(f"{path.relative_to(ROOT)}:{inner.lineno}: {lines[inner.lineno - 1].strip()}")
    assert sorted(set(silent)) == []


def _calls(body: list[ast.stmt]) -> list[ast.stmt]:
    """The statements of ``body`` that do something: not an import, not a name given to a part of
    the ``snakemake`` object (``i = snakemake.input``), not a ``return 0``."""
    def alias(node):
        return isinstance(node, ast.Assign) and all(isinstance(v, ast.Attribute) for v in
                                                    (node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]))
    return [node for node in body if not isinstance(node, (ast.Import, ast.ImportFrom)) and not alias(node)
            and not (isinstance(node, ast.Return) and isinstance(node.value, ast.Constant))]


def test_each_rule_script_and_subcommand_is_one_call():
    """A script under scripts/ is start_job and one call of its stage's job; a ``dflash`` subcommand
    one call of the same job (or of its command's function): the settings a stage runs with are
    assembled in one place, the job, not restated by each adapter."""
    for path in sorted((ROOT / "scripts").glob("*.py")):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        calls = [ast.unparse(node) for node in _calls(body)]
        assert calls[0] == "start_job(snakemake)" and len(calls) == 2, (path.name, calls)
    tree = ast.parse((PACKAGE / "cli.py").read_text(encoding="utf-8"))
    registered = {node.args[1].id for node in ast.walk(tree) if isinstance(node, ast.Call)
                  and getattr(node.func, "id", None) == "stage"}
    registered |= {kw.value.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                   and getattr(node.func, "attr", None) == "set_defaults" for kw in node.keywords if kw.arg == "run"}
    handlers = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name in registered}
    assert len(handlers) == len(registered) >= 15
    for name, node in handlers.items():
        assert len(_calls(node.body)) == 1, (name, [ast.unparse(n) for n in _calls(node.body)])
