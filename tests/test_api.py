"""The public API and the package's layering, pinned so that they change only on purpose."""

from __future__ import annotations

import ast
import importlib
import pkgutil
import re
from pathlib import Path

import combee_stream
from combee_stream import errors

PACKAGE = Path(combee_stream.__file__).parent

PUBLIC_API = [
    "CombeeError",
    "Config",
    "ConfigError",
    "Engine",
    "Feedback",
    "Playbook",
    "PromptSubscriber",
    "PromptUpdate",
    "Step",
    "Trace",
    "TraceProducer",
    "UserError",
    "load_config",
    "run_learn",
]


def modules() -> list[str]:
    names = ["combee_stream"]
    for info in pkgutil.walk_packages([str(PACKAGE)], prefix="combee_stream."):
        if info.name != "combee_stream.__main__":
            names.append(info.name)
    return names


def imports_of(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


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
    from combee_stream.core.learner import WindowError
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


def test_kafka_holds_only_kafka() -> None:
    for path in (PACKAGE / "kafka").glob("*.py"):
        learning = {m for m in imports_of(path) if m.startswith("combee_stream.core")}
        assert learning == set(), f"{path.name} imports the learning core: {learning}"


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
