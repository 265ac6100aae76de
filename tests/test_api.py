"""The public API and the package's layering, pinned so that they change only on purpose."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import combee_stream
from combee_stream import errors

PACKAGE = Path(combee_stream.__file__).parent

PUBLIC_API = [
    "AcceptAll",
    "BrokerError",
    "BrokerUnavailableError",
    "CalculatorError",
    "Candidate",
    "CombeeError",
    "Config",
    "ConfigError",
    "DecodeError",
    "Engine",
    "EngineHalted",
    "FailedTrace",
    "Feedback",
    "GateChain",
    "KeyChain",
    "KeyPipeline",
    "LLMCallError",
    "Learner",
    "MemorySink",
    "MissingEndpointError",
    "Pending",
    "PipelineSettings",
    "Playbook",
    "PromptSubscriber",
    "PromptUpdate",
    "PublishGate",
    "SchemaVersionError",
    "Sink",
    "StateLostError",
    "Step",
    "TopicLostError",
    "TopicMismatchError",
    "TopicMissingError",
    "Trace",
    "TraceFormat",
    "TraceProducer",
    "UndecodableStateError",
    "UpdateTooLarge",
    "UserError",
    "Verdict",
    "Window",
    "WindowError",
    "build_gate",
    "build_learner",
    "closed_inbox",
    "load_config",
    "run_learn",
]

# The package's layers, bottom up. A package (a subpackage, or a module at the top) imports
# only packages of the layers below its own, and of those only what MAY_IMPORT names: so the
# package graph has no circle and nothing imports upwards. Every import counts: at module
# level, in a function, under TYPE_CHECKING.
LAYERS: list[set[str]] = [
    {"errors"},
    {"tokens", "retry", "logs", "buildcache", "progress"},
    {"schemas"},
    {"config"},
    {"http", "formats", "otel"},
    {"kafka"},
    {"llm"},
    {"core"},
    {"engine", "offline", "ingest", "prompts_cli", "schema_cli"},  # drivers, side by side
    {"agent", "tasks"},
    {"evaluation"},
    {"wiring", "sim", "localllm"},
    {"combee_stream", "bench", "demo"},  # the public API's facade, and the developer tools
    {"cli", "run_cli", "learn_cli"},  # the composition root
    {"__main__"},
]
BASE = {"errors", "tokens", "retry", "logs", "schemas", "config"}

MAY_IMPORT: dict[str, set[str]] = {
    "errors": set(),
    "tokens": set(),
    "retry": set(),
    "logs": set(),
    "progress": set(),  # a phase's progress on stderr (learn, bench quality)
    "buildcache": set(),  # the user-level cache of source builds (llama-server, the Collector)
    "schemas": {"errors"},
    "config": {"errors", "schemas"},
    "http": set(),
    "formats": BASE,
    "otel": set(),
    "kafka": BASE | {"formats"},  # nothing about learning
    "llm": BASE,  # no Kafka
    "core": BASE | {"llm"},  # the learning core: no Kafka, no formats, no agent
    "engine": BASE | {"http", "formats", "kafka", "llm", "core"},
    "offline": BASE | {"formats", "llm", "core", "progress"},
    "ingest": BASE | {"http", "formats", "kafka"},  # telemetry in, traces out: no learning
    "prompts_cli": BASE | {"kafka", "core"},
    "schema_cli": BASE,
    "agent": BASE | {"kafka"},  # the SDK: no LLM layer, no learning core
    "tasks": BASE,
    "evaluation": BASE | {"kafka", "llm", "core", "tasks"},
    "wiring": BASE | {"kafka", "llm", "core", "engine", "offline", "evaluation"},
    "sim": BASE | {"http", "core", "tasks", "evaluation"},
    "localllm": BASE | {"buildcache", "http"},
    "combee_stream": BASE | {"formats", "kafka", "llm", "core", "evaluation", "wiring"},
    "bench": set().union(*LAYERS[:12]) - {"combee_stream"},
    "demo": set().union(*LAYERS[:12]) - {"combee_stream"},
    "cli": BASE,  # the commands' modules it registers are named as strings
    "__main__": {"cli"},
    "run_cli": BASE | {"ingest", "wiring"},
    "learn_cli": BASE | {"core", "wiring"},
}


def modules() -> list[str]:
    names = ["combee_stream"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="combee_stream."):
        if info.name != "combee_stream.__main__":
            names.append(info.name)
    return names


def module_files() -> dict[str, Path]:
    """Every module of the package by its dotted name (``__main__`` included)."""
    out: dict[str, Path] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def internal_imports(name: str, path: Path, known: set[str]) -> set[str]:
    """The package's modules that module ``name`` imports, anywhere in it (function-level and
    TYPE_CHECKING imports too); ``from a import b`` counts as ``a.b`` when that is a module."""
    found: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parent, *([node.module] if node.module else [])])
            targets = [
                f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names
            ]
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else parts[0]


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: internal_imports(name, path, set(files)) for name, path in files.items()}


def test_the_public_api_is_exactly_this() -> None:
    assert sorted(combee_stream.__all__) == PUBLIC_API
    for name in PUBLIC_API:
        assert getattr(combee_stream, name) is not None


def test_every_module_declares_all_and_every_name_in_it_exists() -> None:
    for name in modules():
        module = importlib.import_module(name)
        exported = getattr(module, "__all__", None)
        assert isinstance(exported, list), f"{name} has no __all__"
        missing = [n for n in exported if not hasattr(module, n)]
        assert missing == [], f"{name}.__all__ names {missing}"


def test_the_package_is_typed() -> None:
    assert (PACKAGE / "py.typed").is_file()


def test_every_error_the_package_defines_derives_from_the_root_and_is_in_the_tree() -> None:
    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.CombeeError), name
    from combee_stream.core.results import WindowError
    from combee_stream.llm import LLMCallError, MissingEndpointError

    for error in (WindowError, LLMCallError, MissingEndpointError):
        assert issubclass(error, errors.CombeeError)
    assert issubclass(MissingEndpointError, errors.UserError)
    # Every public exception class of every module, so a new one cannot skip the tree or its
    # drawing in errors.py.
    tree = errors.__doc__ or ""
    for name in modules():
        for attr, obj in vars(importlib.import_module(name)).items():
            if (
                isinstance(obj, type)
                and issubclass(obj, BaseException)
                and obj.__module__ == name
                and not attr.startswith("_")
            ):
                assert issubclass(obj, errors.CombeeError), f"{name}.{attr}"
                drawn = re.search(rf"^[│├└─ ]*{attr}\b", tree, re.MULTILINE)
                assert drawn, f"{name}.{attr} is not drawn in errors.py"


def test_the_layer_table_itself_points_only_down() -> None:
    layer = {package: i for i, packages in enumerate(LAYERS) for package in packages}
    assert set(layer) == set(MAY_IMPORT), "every package has a layer and a row"
    for package, allowed in MAY_IMPORT.items():
        upward = sorted(q for q in allowed if layer[q] >= layer[package])
        assert upward == [], f"{package} may import {upward}, not below it"


def test_every_package_imports_only_what_its_layer_allows() -> None:
    graph = import_graph()
    unknown = sorted({package_of(m) for m in graph} - set(MAY_IMPORT))
    assert unknown == [], f"packages without a place in LAYERS: {unknown}"
    broken = sorted(
        f"{module} -> {target}"
        for module, targets in graph.items()
        for target in targets
        if package_of(target) != package_of(module)
        and package_of(target) not in MAY_IMPORT[package_of(module)]
    )
    assert broken == [], "imports the package rules forbid:\n" + "\n".join(broken)


def test_no_module_imports_itself_through_a_circle() -> None:
    graph = import_graph()
    done: set[str] = set()
    circles: list[list[str]] = []

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append([*path[path.index(module) :], module])
            return
        if module in done:
            return
        for target in sorted(graph[module]):
            visit(target, [*path, module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    assert circles == []


def test_the_learning_core_reads_no_files_and_speaks_to_no_broker_or_endpoint() -> None:
    """Its stores, sizes, prompts and LLM are handed to it (the wiring): no file, Kafka or HTTP
    library is imported in core/, and nothing there opens a file."""
    outside = {"pathlib", "os", "io", "importlib", "shutil", "tempfile", "aiokafka", "openai"}
    outside |= {"httpx2", "uvicorn", "sqlite3"}
    for path in (PACKAGE / "core").glob("*.py"):
        roots = {m.split(".")[0] for m in imports_of(path)}
        assert roots & outside == set(), f"core/{path.name} imports {roots & outside}"
        calls = [
            node
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name | ast.Attribute)
            and (getattr(node.func, "id", None) == "open"
                 or getattr(node.func, "attr", None) in {"open", "read_text", "write_text"})
        ]  # fmt: skip
        assert calls == [], f"core/{path.name} opens a file"


def test_the_public_api_is_loaded_from_the_homes_its_type_imports_name() -> None:
    """The facade loads its names lazily from a table; the TYPE_CHECKING imports say the same,
    so the package rules above see every import the facade makes."""
    init = ast.parse((PACKAGE / "__init__.py").read_text())
    declared = {
        alias.name: node.module
        for node in ast.walk(init)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("combee_stream")
        for alias in node.names
    }
    homes = vars(combee_stream)["_HOMES"]
    assert homes == declared
    assert sorted(homes) == PUBLIC_API
    for name, home in homes.items():
        assert getattr(combee_stream, name) is getattr(importlib.import_module(home), name)


def test_the_agent_sdk_loads_neither_the_llm_layer_nor_the_learning_core() -> None:
    code = (
        "import sys\n"
        "from combee_stream.agent import PromptClient, RunRecorder, TraceProducer\n"
        "from combee_stream import Feedback, Trace, TraceProducer as Same\n"
        "assert Same is TraceProducer\n"
        "print('\\n'.join(sorted(m for m in sys.modules if m.startswith('combee_stream'))))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    loaded = done.stdout.split()
    assert "combee_stream.agent.prompts" in loaded and "combee_stream.kafka.producer" in loaded
    heavy = [
        m for m in loaded if package_of(m) in {"llm", "core", "engine", "evaluation", "wiring"}
    ]
    assert heavy == []


def test_every_exception_of_the_tree_is_public_and_every_public_one_is_drawn() -> None:
    tree = errors.__doc__ or ""
    drawn = set(re.findall(r"^[│├└─ ]*([A-Z]\w+)\s", tree.split("```")[1], re.MULTILINE))
    exported = {
        name
        for name in PUBLIC_API
        if isinstance(getattr(combee_stream, name), type)
        and issubclass(getattr(combee_stream, name), BaseException)
    }
    assert exported == drawn


def test_the_llm_layer_is_modules_of_one_job_each() -> None:
    sizes = {p.name: len(p.read_text().splitlines()) for p in (PACKAGE / "llm").glob("*.py")}
    assert not (PACKAGE / "core" / "llm.py").exists()
    assert {name for name, lines in sizes.items() if lines >= 400} == set()


def test_prompt_updates_are_built_in_one_module() -> None:
    builders = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "PromptUpdate"
            ):
                builders.append(path.relative_to(PACKAGE).as_posix())
    assert set(builders) == {"core/versions.py"}


def test_the_products_prompts_carry_nothing_of_the_simulator() -> None:
    for path in (PACKAGE / "core" / "prompts").glob("*.md"):
        text = path.read_text()
        assert "LESSON" not in text, path.name
        assert "simulat" not in text.lower(), path.name
