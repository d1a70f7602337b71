"""The shape of the code, checked: small modules, no import cycles, nothing imported from a higher layer,
and the engine naming no format or family (they reach it only through the registries)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers.structure import PACKAGE, imports, modules

MAX_LINES = 400
# Lower layers never import higher ones. An entry names a module or a package (below distmerge.); a module takes
# the layer of the longest entry that is it or a package above it (engine.run is 5, the rest of engine/ 4).
LAYERS = {
    0: ("errors", "dtypes", "results", "threads", "input", "s3_client", "distributed.watchdog",
        "distributed.namespaces", "distributed.held_defaults", "option_kinds", "natural_order", "disjoint_sets",
        "testing_seams"),
    1: ("formats", "distributed.comm", "distributed.requests", "families.transforms", "quantize"),
    # output_options: its --quantize choices are the scheme registry's (quantize/schemes.py)
    2: ("families", "quantize.table", "quantize.fused", "average", "output_options"),
    3: ("engine.plan", "engine.placement", "engine.coverage", "engine.spread", "engine.inventory",  # the plan's
        "output", "catalog"),  # every family, transform and rewrite, above them all (catalog.py)
    4: ("engine", "report"),
    5: ("engine.run", "front.inspect", "verifier", "watcher", "importer", "options", "api"),
    6: ("front", "__main__", "hooks"),
}
# The modules at the top of distmerge/: what every part uses, and the API. A new module belongs to a part.
TOP = {"__init__", "__main__", "api", "errors", "dtypes", "results", "threads", "report", "s3_client", "catalog",
       "output_options", "option_kinds", "natural_order", "disjoint_sets", "testing_seams"}
# Inside a package, the same rule one level down: its modules' layers among themselves.
SUBLAYERS = {
    "verifier": {
        0: ("report", "sides", "components"),
        1: ("listing", "totals"),
        2: ("blocks", "kinds", "plot"),
        3: ("stream", "bounded", "logits"),
        4: ("compare", "checkpoint"),
        5: ("two_checkpoints",),
        6: ("run",),
    },
    "watcher": {
        0: ("choose", "markers", "outcome"),
        1: ("steps", "summary"),
        2: ("done",),
        3: ("step",),
        4: ("average",),
        5: ("passes",),
    },
}
# The modules that reach formats and families only through their registries (a package: all its modules).
ENGINE = ("engine", "input", "output", "inspect")


def layer(module: str) -> int:
    """The layer of the longest LAYERS entry that is `module` (below distmerge.) or a package above it."""
    rel = module.removeprefix("distmerge.")
    found = [(len(name), n) for n, names in LAYERS.items() for name in names
             if rel == name or rel.startswith(name + ".")]
    return max(found)[1] if found else -1


def test_no_module_is_too_long():
    long = {m: n for m, p in modules().items() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, long


def only_a_docstring(path: Path) -> bool:
    """A package's __init__ that only describes its modules (distmerge/engine/, input/): no layer of its own."""
    body = ast.parse(path.read_text()).body
    return path.name == "__init__.py" and len(body) == 1 and isinstance(body[0], ast.Expr)


def test_every_module_has_a_layer():
    assert [m for m, p in modules().items() if m != "distmerge" and layer(m) < 0 and not only_a_docstring(p)] == []


def test_nothing_imports_a_higher_layer():
    mods = modules()
    upward = [(m, i) for m, p in mods.items() for i in imports(p, set(mods)) if i != "distmerge"
              and m != "distmerge" and layer(i) > layer(m)]
    assert upward == []


def test_no_import_cycles():
    mods = modules()
    graph = {m: imports(p, set(mods)) - {m, "distmerge"} for m, p in mods.items()}
    # A package's __init__ importing its own modules (registration) is not a cycle back into it.
    graph = {m: {i for i in deps if not (m in graph.get(i, ()) and i.startswith(m + "."))} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, trail: list[str]) -> None:
        state[m] = 1
        for dep in sorted(graph[m]):
            if state.get(dep) == 1:
                raise AssertionError("import cycle: " + " -> ".join(trail[trail.index(dep):] + [dep]))
            if dep not in state:
                visit(dep, trail + [dep])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])


def test_engine_names_no_format_or_family():
    """Formats and families plug in through their registries: the engine modules import none by name."""
    mods = modules()
    plugins = {m for m in mods if m.startswith(("distmerge.formats.", "distmerge.families."))}
    # families.transforms: the layout functions a unit names by string (Unit.transform), applied by assemble
    allowed = {"distmerge.formats.base", "distmerge.formats.registry", "distmerge.families.base",
               "distmerge.families.transforms"}
    engine = [m for m in mods if any(m == f"distmerge.{e}" or m.startswith(f"distmerge.{e}.") for e in ENGINE)]
    named = [(e, i) for e in engine for i in imports(mods[e], set(mods)) if i in plugins - allowed]
    assert named == []


def test_inside_a_package_nothing_imports_a_higher_sublayer():
    """verify/'s modules: the figures and listings below the comparisons, the comparisons below the runs."""
    mods = modules()
    for package, table in SUBLAYERS.items():
        prefix = f"distmerge.{package}."
        level = {f"{prefix}{name}": n for n, names in table.items() for name in names}
        members = {m for m in mods if m.startswith(prefix)}
        assert members == set(level), (package, sorted(members ^ set(level)))
        upward = [(m, i) for m in members for i in imports(mods[m], set(mods)) if i in level and level[i] > level[m]]
        assert upward == [], upward


def test_the_top_holds_only_what_every_part_uses():
    """Everything else belongs to a part: quantize/, front/, options/, distributed/, engine/ ... (#35)."""
    top = {p.stem for p in PACKAGE.glob("*.py")}
    assert top == TOP, sorted(top ^ TOP)


def test_verify_is_the_function():
    """`distmerge.verify` is the API's function whatever was imported before (the package is distmerge.verifier)."""
    import distmerge
    import distmerge.verifier.run  # noqa: F401
    from distmerge import api

    assert distmerge.verify is api.verify and distmerge.merge is api.merge


def test_a_package_attribute_is_the_package():
    """`import distmerge.families.megatron as m` gives the package, not a module an alias put in its place (the
    registries' `from ...megatron import family as megatron` did)."""
    import importlib
    import sys

    mods = modules()
    for name in sorted(mods):
        importlib.import_module(name)
    wrong = [n for n in mods if "." in n and getattr(sys.modules[n.rsplit(".", 1)[0]], n.rsplit(".", 1)[1], None)
             is not sys.modules[n]]
    assert wrong == []


# Folders, as layers of their own: a folder imports nothing from a folder above it (an arrow of the folders'
# drawing that runs back up). The input side: input/ (the sources: where the checkpoint's bytes come from) is below
# formats/ (what the bytes mean), which is below engine/ (discovery, the reader, the rounds); the plug-ins
# (families/, then quantize/ and average/, which rewrite a family's result) and output/ (where the model goes) below
# the engine; the verifier and the watcher use the engine; options/ (the table of options) knows them all, and
# front/ and hooks/ are the doors. The modules at the top of distmerge/ have their own layers (LAYERS).
FOLDERS = {"input": 0, "distributed": 1, "formats": 1, "families": 2, "quantize": 3, "average": 3, "output": 3,
           "engine": 4, "verifier": 5, "watcher": 5, "importer": 5, "options": 6, "front": 7, "hooks": 7}


def folder(path: Path) -> str | None:
    """The folder of distmerge/ a module is in (a package's __init__ too), None at the top."""
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else None


def upward_folder_arrows() -> list[tuple[str, str]]:
    """Each import of a module of a higher folder, as (importer, imported)."""
    mods = modules()
    return [(m, i) for m, p in mods.items() if folder(p) for i in imports(p, set(mods))
            if folder(mods[i]) and FOLDERS[folder(mods[i])] > FOLDERS[folder(p)]]


def test_every_folder_has_a_place():
    assert {folder(p) for p in modules().values()} - {None} == set(FOLDERS)


def test_no_folder_imports_a_folder_above_it():
    """Shown to fail on the code before #44: four arrows (engine/resume -> options, verifier/kinds -> options,
    watcher/step -> front/hub, families -> quantize)."""
    assert upward_folder_arrows() == []


# The formats read the input only through the Source they are handed (input/source.py): no file system call of their
# own, so a layout read from a folder is read the same from a bucket (#35). A file system method (`.open`, `.is_file`,
# `.iterdir` ...) is called on the source (a name `source` or `src`, or an attribute `.source` / `.src`), or it is a
# format's own `open`, whose first argument is the source.
FS_METHODS = {"open", "read_bytes", "read_text", "write_bytes", "write_text", "exists", "is_file", "is_dir",
              "is_symlink", "iterdir", "glob", "rglob", "stat", "lstat", "resolve", "readlink", "samefile",
              "listdir", "scandir", "touch", "unlink", "mkdir", "FileIO"}
FS_MODULES = {"os", "shutil", "glob", "tempfile", "mmap", "pathlib"}  # io: its BytesIO is memory (io.open: above)
PURE_PATHS = {"join", "basename", "dirname", "normpath", "relpath", "splitext", "sep"}  # names, not lookups
# Lookups of a source by path, past the one the format was handed; each exception with its reason.
LOOKUPS = {"of", "find", "session", "looking_at", "open_source", "open_input", "open_any", "InputTree"}
LOOKUPS_ALLOWED = {
    "distmerge/formats/registry.py": {"looking_at"},  # detect/pick take a folder as well as a Source (verify, verl)
    "distmerge/formats/base_model.py": {"open_source"},  # --base-model: the user's own folder, a source of its own
}


def _on_the_source(node: ast.expr) -> bool:
    return (isinstance(node, ast.Name) and node.id in ("source", "src")) or (
        isinstance(node, ast.Attribute) and node.attr in ("source", "src"))


def _own_io(call: ast.Call, allowed: set[str]) -> str | None:
    """What is wrong with a call in a format module, or None."""
    fn = call.func
    if isinstance(fn, ast.Name):
        return f"{fn.id}()" if fn.id == "open" or (fn.id in LOOKUPS and fn.id not in allowed) else None
    if not isinstance(fn, ast.Attribute):
        return None
    base = fn.value
    while isinstance(base, ast.Attribute):  # os.path.isfile -> os
        base = base.value
    if isinstance(base, ast.Name) and base.id in FS_MODULES and fn.attr not in PURE_PATHS:
        return ast.unparse(fn)
    if fn.attr in LOOKUPS and fn.attr not in allowed:
        return ast.unparse(fn)
    if fn.attr in FS_METHODS and not _on_the_source(fn.value):
        is_format_open = fn.attr == "open" and call.args and _on_the_source(call.args[0])
        return None if is_format_open else ast.unparse(fn)
    return None


def test_formats_read_only_through_their_source():
    """Shown to fail with a format reading a marker by its path (`json.loads(Path(p).read_text())`), listing a folder
    with `os.listdir`, or opening a rank file with `tree.open_input` (which looks the source up by path)."""
    found = []
    for path in sorted((PACKAGE / "formats").rglob("*.py")):
        rel = str(path.relative_to(PACKAGE.parent))
        allowed = LOOKUPS_ALLOWED.get(rel, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and (wrong := _own_io(node, allowed)):
                found.append(f"{rel}:{node.lineno} {wrong}")
    assert found == []


# The quantize part (distmerge/quantize/) plugs in as a family does: outside it, at most this many files name it (#35:
# 19 then). The engine and the verifier reach it through generic hooks (families.base.register_rewrite, the plan's
# config_later, verify's Listing.encoding); what names it: its option's declaration, its registration, verify's bridge.
QUANTIZE_NAMED_IN = 4


def _names_the_quantize_part(path: Path, known: set[str]) -> bool:
    """The file imports a module of distmerge/quantize/ (a lazy import too), or names one in a string (an import by
    name: "distmerge.quantize.fp8", "distmerge/quantize/table.py")."""
    if any(i == "distmerge.quantize" or i.startswith("distmerge.quantize.") for i in imports(path, known)):
        return True
    strings = [n.value for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Constant)
               and isinstance(n.value, str)]
    return any(re.search(r"distmerge[./]quantize\b", s) for s in strings)


def test_few_files_name_the_quantize_part():
    """Shown to fail on the code of #35 (6 files: engine/plan.py, engine/finalize.py, verifier/listing.py,
    fp8_compare.py, fp4_compare.py, families/__init__.py)."""
    mods = modules()
    named = sorted(str(p.relative_to(PACKAGE.parent)) for m, p in mods.items()
                   if not (m == "distmerge.quantize" or m.startswith("distmerge.quantize."))
                   and _names_the_quantize_part(p, set(mods)))
    assert len(named) <= QUANTIZE_NAMED_IN, named


def side_effect_imports(path: Path) -> list[str]:
    """The names imported from distmerge in a file that the file never uses: kept for what importing does
    (a module registering itself). A package's __init__ may re-export names (`from x import y`), not import a
    module for nothing (`import distmerge.families.hf`)."""
    tree = ast.parse(path.read_text())
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            mods = [a for a in node.names if a.name.startswith("distmerge.")]
            bound = [a.asname or a.name.split(".")[0] for a in mods]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distmerge"):
            if path.name == "__init__.py":
                continue  # a re-export
            bound = [a.asname or a.name for a in node.names]
        else:
            continue
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {b}" for b in bound if b not in used]
    return found


def test_nothing_is_imported_for_its_side_effect():
    """Families, transforms, folds, rewrites (distmerge/catalog.py) and formats (formats/registry.py) are listed
    where they are registered, so no module is imported only to make it register itself. Shown to fail on the code
    before #44 (six: formats/registry.py, average/units.py, verifier/listing.py, three families' family.py; and
    families/__init__.py's imports of every family and of quantize.table)."""
    found = [f for p in sorted(PACKAGE.rglob("*.py")) for f in side_effect_imports(p)]
    assert found == []


# Test hooks and per-process state (#44): the fault tests' variables are read in one module, the test seams, and
# each piece of per-process or per-merge state has one owner.
SEAMS = "distmerge/testing_seams.py"
NAMESPACES = "distmerge/distributed/namespaces.py"


def test_production_modules_read_no_test_variable():
    """Only the test-seam module names a `DISTMERGE_TEST_` variable: every other module calls its seams. Shown to
    fail on the code before #44 (s3_client.py, engine/run.py, output/s3.py, distributed/comm.py, front/cli.py)."""
    naming = sorted(str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
                    if "DISTMERGE_TEST_" in p.read_text())
    assert naming == [SEAMS]


def module_counters(path: Path) -> list[str]:
    """The `itertools.count()` a module keeps for the whole process (assigned at module or class level), as
    PATH:LINE; a count made inside a function lives for its call only."""
    tree = ast.parse(path.read_text())
    kept = [n for n in (*tree.body, *(b for c in tree.body if isinstance(c, ast.ClassDef) for b in c.body))
            if isinstance(n, ast.Assign | ast.AnnAssign) and n.value is not None]
    return [f"{path.relative_to(PACKAGE.parent)}:{n.lineno}" for n in kept for call in ast.walk(n.value)
            if isinstance(call, ast.Call) and ast.unparse(call.func) in ("itertools.count", "count")]


def test_one_counter_names_the_store_namespaces():
    """The store namespaces of the groups a process starts (comm.py's group, its watchdog) come from one counter,
    in distributed/namespaces.py: two counters that must give every rank the same sequence are one too many.
    Shown to fail on the code before #44 (comm._GROUPS and watchdog/dog._COMMS)."""
    found = [c for p in sorted(PACKAGE.rglob("*.py")) for c in module_counters(p)]
    assert [c.split(":")[0] for c in found] == [NAMESPACES], found


def test_a_context_variable_is_touched_only_by_its_module():
    """A ContextVar (input/source.py's session of a merge) is read and set only in the module that defines it;
    others use that module's named entry points (source.fresh_session). Shown to fail with watcher/step.py
    resetting the session itself (`input_source._SESSION.set(None)`)."""
    mods = modules()
    owners = {t.id: p for p in mods.values() for n in ast.parse(p.read_text()).body
              if isinstance(n, ast.Assign | ast.AnnAssign) and isinstance(n.value, ast.Call)
              and ast.unparse(n.value.func).endswith("ContextVar")
              for t in (n.targets if isinstance(n, ast.Assign) else [n.target]) if isinstance(t, ast.Name)}
    assert owners, "no ContextVar found: the check would see nothing"
    touched = sorted(f"{p.relative_to(PACKAGE.parent)}: {name}" for name, owner in owners.items()
                     for p in mods.values() if p != owner and re.search(rf"\b{name}\b", p.read_text()))
    assert touched == []


def test_no_test_module_imports_another():
    """Shared test code lives in tests/helpers/ (or conftest.py fixtures): a test module imported by another runs its
    module-level setup twice and ties the two files' fates together. Seen to fail: test_import_megatron_moe.py
    imported four helpers from test_import_megatron.py."""
    tests = Path(__file__).resolve().parent
    found = []
    for path in sorted(tests.glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else (
                [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.name}: {n}" for n in names if n.split(".")[-1].startswith("test_")
                      and n.startswith("tests.")]
    assert found == [], found
