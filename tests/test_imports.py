"""The package's import graph: no cycles, and epo_cli modules imported at module level (issue 14).

The graph is read from the source with `ast` (nothing is imported): every `import` / `from ... import` of an
epo_cli module, at module level and inside functions (a function-level import is still an edge: it runs
whenever the function does), without `if TYPE_CHECKING:` blocks (they never run). Relative imports and
`from package import module` resolve to the module; importing `a.b.c` also runs the package `a.b`'s
__init__. Registries that import by name (`"epo_cli.envs.household:HouseholdSuite"` strings, which
epo_cli.registry imports when the name is first used) are edges too, since those imports run as soon as a
name is looked up.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "epo_cli"

#: function-level imports of epo_cli modules that stay, with why (importer, imported) -> reason
ALLOWED_FUNCTION_IMPORTS: dict[tuple[str, str], str] = {
    **{("epo_cli.cli", target): "`epo --help` and `epo config show` load no torch: the commands that train, "
       "play or plot import torch (and, for report, numpy) only when they run"
       for target in ("epo_cli.launch.local", "epo_cli.evaluation.run", "epo_cli.analysis.report")},
    ("epo_cli.launch.slurm", "epo_cli.launch.rank"): "the submitting process pickles SlurmRank without loading "
                                                     "torch; the SLURM task imports the rank's code when it runs",
}


@dataclass(frozen=True)
class Import:
    importer: str
    target: str
    line: int
    in_function: bool
    by_name: bool = False  # a "module:Attr" registry string, imported through importlib
    implied: bool = False  # the package whose __init__ runs before the named module


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for the package at `root` (a package's name is its __init__.py's)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module that `name` (a module, or an attribute of one) lives in."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports_of(module: str, modules: dict[str, Path]) -> list[Import]:
    """Every import of a module of the package made by `module`."""
    path = modules[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    found: list[Import] = []

    def add(name: str | None, node: ast.AST, in_function: bool, by_name: bool = False) -> None:
        target = _known(name, modules) if name else None
        if target is None or target == module:
            return
        found.append(Import(module, target, node.lineno, in_function, by_name))
        # importing a.b.c runs a.b's __init__ first (unless a.b is being imported already: an ancestor)
        parent = target.rpartition(".")[0]
        while parent and parent in modules and not (module + ".").startswith(parent + "."):
            found.append(Import(module, parent, node.lineno, in_function, by_name, implied=True))
            parent = parent.rpartition(".")[0]

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _is_type_checking(child):
                for other in child.orelse:  # `else:` of TYPE_CHECKING runs
                    visit_node(other, in_function)
                continue
            visit_node(child, in_function)

    def visit_node(node: ast.AST, in_function: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name, node, in_function)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from ..pkg import y
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module or ""
            for alias in node.names:  # `from pkg import mod` imports the module pkg.mod
                full = f"{source}.{alias.name}"
                add(full if full in modules else source, node, in_function)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and ":" in node.value:
            name = node.value.split(":", 1)[0]
            if name in modules:
                add(name, node, True, by_name=True)
        else:
            inner = in_function or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(node, inner)

    visit(tree, False)
    return found


def import_graph(root: Path) -> tuple[dict[str, set[str]], list[Import]]:
    modules = module_files(root)
    imports = [imp for module in modules for imp in imports_of(module, modules)]
    graph: dict[str, set[str]] = {module: set() for module in modules}
    for imp in imports:
        graph[imp.importer].add(imp.target)
    return graph, imports


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Cycles as [a, b, ..., a], enough to cover every module on one: the strongly connected components
    (Tarjan), and in each the shortest cycle through its first module (sorted order) not on one yet."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(v: str) -> None:  # recursion depth <= number of modules (a few dozen)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        covered: set[str] = set()
        for start in sorted(component):
            if start not in covered:
                cycles.append(_shortest_cycle(graph, component, start))
                covered.update(cycles[-1])
    return sorted(cycles)


def _shortest_cycle(graph: dict[str, set[str]], component: set[str], start: str) -> list[str]:
    previous: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph.get(v, ())):
            if w == start:
                path = [v]
                while path[-1] != start:
                    path.append(previous[path[-1]])
                return [start, *reversed(path[:-1]), start]
            if w in component and w not in previous:
                previous[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in {sorted(component)}")


# ---- the checks on epo_cli --------------------------------------------------------------------------------

def test_the_package_has_no_import_cycles() -> None:
    graph, imports = import_graph(PACKAGE)
    files = module_files(PACKAGE)
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        steps = []
        for a, b in zip(cycle, cycle[1:]):
            where = next(i for i in imports if i.importer == a and i.target == b)
            kind = " (by name)" if where.by_name else " (in a function)" if where.in_function else ""
            kind += " (its package __init__)" if where.implied else ""
            steps.append(f"  {a} -> {b}: {files[a].relative_to(PACKAGE.parent)} line {where.line}{kind}")
        lines.append(" -> ".join(cycle) + "\n" + "\n".join(steps))
    print("\n\n".join(lines))
    assert not cycles, f"{len(cycles)} import cycle(s):\n" + "\n\n".join(lines)


def folder_of(module: str) -> str:
    """The room a module lives in: its folder under epo_cli (epo_cli.training.update -> epo_cli.training), or
    the module itself at the package root (epo_cli.config)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_the_folders_import_one_way() -> None:
    """No folder imports a folder that imports it back, through any chain: the folders stack into floors
    and every import runs down (a cycle between folders is an import that climbs)."""
    graph, imports = import_graph(PACKAGE)
    folders: dict[str, set[str]] = {}
    for module, targets in graph.items():
        folders.setdefault(folder_of(module), set()).update(
            folder_of(t) for t in targets if folder_of(t) != folder_of(module))
    cycles = find_cycles(folders)
    lines = []
    for cycle in cycles:
        for a, b in zip(cycle, cycle[1:]):
            lines += [f"  {i.importer} -> {i.target} (line {i.line})" for i in imports
                      if folder_of(i.importer) == a and folder_of(i.target) == b]
    assert not cycles, f"folders that import each other: {cycles}\n" + "\n".join(lines)


def test_epo_cli_modules_are_imported_at_module_level() -> None:
    """A function-level import of an epo_cli module hides a cycle or a slow import; only the listed ones,
    each with its reason, stay (and the list may not go stale)."""
    _, imports = import_graph(PACKAGE)
    direct = {(i.importer, i.target): i for i in imports if i.in_function and not (i.by_name or i.implied)}
    unlisted = sorted(f"{a} imports {b} inside a function (line {direct[a, b].line})"
                      for a, b in direct if (a, b) not in ALLOWED_FUNCTION_IMPORTS)
    assert not unlisted, "move these imports to module level (or list them, with why):\n" + "\n".join(unlisted)
    stale = sorted(f"{a} -> {b}" for a, b in ALLOWED_FUNCTION_IMPORTS if (a, b) not in direct)
    assert not stale, "no longer function-level imports; remove them from ALLOWED_FUNCTION_IMPORTS:\n" + \
        "\n".join(stale)


# ---- the checker itself can fail --------------------------------------------------------------------------

def test_find_cycles_finds_a_planted_cycle() -> None:
    acyclic = {"a": {"b", "c"}, "b": {"c"}, "c": set(), "d": {"a"}}
    assert find_cycles(acyclic) == []
    planted = {**acyclic, "c": {"d"}}  # one component: a -> c -> d -> a covers all but b, which needs its own
    assert find_cycles(planted) == [["a", "c", "d", "a"], ["b", "c", "d", "a", "b"]]
    two = {"x": {"y"}, "y": {"x"}, "p": {"q"}, "q": {"r"}, "r": {"p"}, "s": {"s"}}
    assert find_cycles(two) == [["p", "q", "r", "p"], ["s", "s"], ["x", "y", "x"]]


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root / "pkg"


def test_import_forms_resolve_to_modules(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": ("from typing import TYPE_CHECKING\n"
                     "from . import b\n"                         # relative, a module
                     "from .sub.c import helper\n"               # relative, an attribute of a module
                     "import pkg.sub\n"
                     "if TYPE_CHECKING:\n    from pkg import d\n"  # never runs: no edge
                     "def f():\n    from pkg.e import thing\n"),  # function-level
        "pkg/b.py": "", "pkg/d.py": "", "pkg/e.py": "",
        "pkg/sub/__init__.py": "from importlib import import_module\nTABLE = {'x': 'pkg.sub.c:Thing'}\n",
        "pkg/sub/c.py": "from ..b import x\n",
    })
    graph, imports = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b", "pkg.sub", "pkg.sub.c", "pkg.e"}
    assert graph["pkg.sub"] == {"pkg.sub.c"} and graph["pkg.sub.c"] == {"pkg.b"}
    in_function = {(i.importer, i.target) for i in imports if i.in_function and not (i.by_name or i.implied)}
    assert in_function == {("pkg.a", "pkg.e")}
    assert find_cycles(graph) == []


def test_a_function_level_import_and_a_registry_name_close_cycles(tmp_path: Path) -> None:
    pkg = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/config.py": "def validate():\n    from pkg.envs import load\n",
        "pkg/envs/__init__.py": "import importlib\nSUITES = {'h': 'pkg.envs.household:Suite'}\n",
        "pkg/envs/household.py": "from pkg.config import validate\n",
    })
    graph, _ = import_graph(pkg)
    assert find_cycles(graph) == [["pkg.config", "pkg.envs", "pkg.envs.household", "pkg.config"]]


@pytest.mark.parametrize("package", ["launch", "analysis", "loggers", "rundir", "evaluation", "runtime"])
def test_the_new_folders_import_nothing_in_their_init(package: str) -> None:
    """`python -m epo_cli.launch.rank` must set OMP_NUM_THREADS before torch loads, and a folder's
    __init__ that imports its modules would run them for every import of any one of them."""
    modules = module_files(PACKAGE)
    assert imports_of(f"epo_cli.{package}", modules) == []


def test_process_start_imports_no_torch_and_deepspeed_gets_its_settings_on_import() -> None:
    """Every epo process calls quiet_libraries() first. It imports no torch (`epo --help` stays fast); the
    first `import deepspeed` then names the accelerator (DS_ACCELERATOR, so DeepSpeed does not probe) and
    no longer imports mlflow through its autotuner (~1.7 s per process and rank), and mlflow still
    imports for logger=mlflow."""
    import os
    import subprocess
    import sys

    code = ("import os, sys\n"
            "from epo_cli.launch.libraries import quiet_libraries\n"
            "quiet_libraries()\n"
            "assert 'torch' not in sys.modules and 'DS_ACCELERATOR' not in os.environ\n"
            "import deepspeed, deepspeed.autotuning.autotuner as autotuner\n"
            "assert os.environ['DS_ACCELERATOR'] == 'cpu'\n"
            "assert 'mlflow' not in sys.modules and autotuner.has_mlflow is False\n"
            "import mlflow\n"
            "assert mlflow.start_run\n"
            "print('ok')\n")
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
    assert "Setting accelerator" not in proc.stderr  # DeepSpeed did not have to guess


# ---- what each command loads: torch and DeepSpeed only where something trains ----------------------------

#: run first in the child: the first import of torch or deepspeed prints the stack that asked for it and ends
#: the process (exit 97), so nothing after it can hide who imported it
FIRST_HEAVY_IMPORT = """
import importlib.abc, os, sys, traceback
class FirstHeavyImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("torch", "deepspeed"):
            stack = [f"{f.filename}:{f.lineno}" for f in traceback.extract_stack()[:-1]]
            sys.__stdout__.write("HEAVY IMPORT " + name + "\\n" + "\\n".join(stack) + "\\n")
            sys.__stdout__.flush()
            os._exit(97)
        return None
sys.meta_path.insert(0, FirstHeavyImport())
"""

#: the sweep's jobs run `epo train` in child processes; here each job fails at once, so the test sees the
#: parent process alone (checking the sweep, running Hydra, recording the jobs, summarising them)
NO_JOBS = ("import epo_cli.launch.sweep as sweep\n"
           "def fail(cmd, out):\n    out.write('error: not run in this test\\n')\n    return 1\n"
           "sweep._run_job = fail\n")
#: the deepspeed launcher's ranks (and the launcher itself) are child processes: here they "fail" at once
NO_RANKS = "import epo_cli.launch.deepspeed as ds\nds._run_ranks = lambda cmd, layout, run, port=None: 1\n"
GRPO_2 = ["algo=grpo", "algo.tasks_per_step=2", "trainer.total_steps=1"]

COMMANDS = [  # (what, argv after `epo`, set-up code, where torch may first be imported: None = nowhere)
    ("epo --help", ["--help"], "", None),
    ("epo config show", ["config", "show", "algo=epo", "curriculum=staged"], "", None),
    ("the sweep parent", ["sweep", "algo=sft,grpo", "trainer.total_steps=1", "output_dir={tmp}"], NO_JOBS, None),
    ("the deepspeed launcher's parent", ["train", *GRPO_2, "launcher=deepspeed", "launcher.num_procs=2",
                                         "run_dir={tmp}/ds"], NO_RANKS, None),
    ("the slurm submission", ["train", "algo=grpo", "launcher=slurm", "launcher.num_nodes=2", "launcher.num_gpus=8",
                              "algo.tasks_per_step=16", "algo.micro_batch_size=4", "run_dir={tmp}/slurm"], "", None),
    ("the local launcher", ["train", "algo=sft", "trainer.total_steps=1", "run_dir={tmp}/local"], "",
     "epo_cli/training/trainer.py"),
]


@pytest.mark.parametrize(("what", "argv", "setup", "first"), COMMANDS, ids=[c[0] for c in COMMANDS])
def test_commands_import_torch_only_to_train(what: str, argv: list[str], setup: str, first: str | None,
                                              tmp_path: Path) -> None:
    """`epo --help`, `epo config show`, a sweep's parent process and the launchers' parents load neither torch
    nor DeepSpeed; `epo train` with the local launcher loads them with the Trainer, not before."""
    import os
    import stat
    import subprocess
    import sys

    bin_dir = tmp_path / "bin"  # stands in for SLURM (as in test_distributed.py): answers like sbatch
    bin_dir.mkdir()
    for tool, script in (("sbatch", "#!/bin/sh\necho 'Submitted batch job 4242'\n"), ("srun", "#!/bin/sh\nexit 1\n")):
        (bin_dir / tool).write_text(script)
        (bin_dir / tool).chmod((bin_dir / tool).stat().st_mode | stat.S_IEXEC)
    args = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    code = (FIRST_HEAVY_IMPORT + setup + f"sys.argv = ['epo', *{args!r}]\n"
            "from epo_cli.cli import main\nmain()\n")
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)
    heavy = proc.stdout[proc.stdout.find("HEAVY IMPORT"):] if "HEAVY IMPORT" in proc.stdout else ""
    if first is None:
        assert not heavy, f"{what} imported {heavy}"
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    else:
        assert heavy and proc.returncode == 97, f"{what} never imported torch:\n{proc.stdout[-2000:]}"
        assert first in heavy, f"{what} imported torch before the Trainer:\n{heavy}"
