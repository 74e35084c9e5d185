"""The engine's slow first-use imports run on a thread while the model loads, a module that is
not installed is skipped without failing the start, and packages whose inits import more than
the engine uses are deferred (their submodules import alone; a name of theirs runs the init)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from ninfer.engine.background_imports import (
    DEFERRED_INITS,
    MODULES,
    defer_package_init,
    start_background_imports,
    wait_for_background_imports,
)

# In a fresh interpreter: this test process imported everything long since.
CHECK = """
import sys
import ninfer.engine.builder
assert "torch._dynamo" not in sys.modules, "the engine's modules import torch's compiler stack again"
from ninfer.engine.background_imports import start_background_imports
thread = start_background_imports(("torch.nn.attention.bias", "no_such_module_here"))
thread.join(120)
assert not thread.is_alive() and "torch.nn.attention.bias" in sys.modules and "torch._dynamo" in sys.modules
print("ok")
"""


def test_the_engine_modules_leave_the_compiler_stack_to_the_background_thread():
    result = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_every_module_the_kernels_import_lazily_is_listed():
    # The mask and fla's chunked rule (kernels/gated_delta_rule/triton.py's _fla_chunk) are what
    # the thread exists for; the thread tolerates the fla modules' absence on CPU installs.
    assert MODULES[0] == "torch.nn.attention.bias"
    source = (Path(__file__).resolve().parents[2] / "ninfer/kernels/gated_delta_rule/triton.py").read_text()
    for name in MODULES[1:]:
        assert f"from {name} import" in source, name
    for name in DEFERRED_INITS:  # each a package between fla and a module the thread imports
        assert any(module.startswith(f"{name}.") for module in MODULES), name
    thread = start_background_imports(MODULES)
    thread.join(120)
    assert not thread.is_alive() and "torch.nn.attention.bias" in sys.modules


def _package(root: Path, name: str) -> None:
    """A package whose __init__ imports a heavy submodule and exports a name of a light one; every
    module appends its name to RUN (in <name>_record) when it runs."""
    (root / f"{name}_record.py").write_text("RUN = []\n")
    package = root / name
    (package / "nested").mkdir(parents=True)
    record = f"from {name}_record import RUN\n"
    init = "RUN.append('init')\nfrom . import heavy\nfrom .light import VALUE as EXPORTED\n"
    (package / "__init__.py").write_text(record + init)
    (package / "heavy.py").write_text(record + "RUN.append('heavy')\n")
    (package / "light.py").write_text(record + "RUN.append('light')\nVALUE = 7\n")
    (package / "nested" / "__init__.py").write_text(record + "RUN.append('nested')\n")
    (package / "nested" / "leaf.py").write_text(record + "RUN.append('leaf')\n")


@pytest.fixture
def package(tmp_path, monkeypatch):
    name = f"deferred_pkg_{tmp_path.name.replace('-', '_')}"
    _package(tmp_path, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    for module in [m for m in sys.modules if m == name or m.startswith((f"{name}.", f"{name}_"))]:
        del sys.modules[module]


def test_a_deferred_package_imports_its_submodules_without_its_init(package):
    assert defer_package_init(package)
    leaf = importlib.import_module(f"{package}.nested.leaf")
    light = importlib.import_module(f"{package}.light")
    run = importlib.import_module(f"{package}_record").RUN
    assert run == ["nested", "leaf", "light"] and light.VALUE == 7
    parent = sys.modules[package]
    assert parent.light is light and parent.nested.leaf is leaf  # submodules held as imported
    # A name the package itself defines runs its init, once; the submodules already imported stay.
    exported = importlib.import_module(package).EXPORTED
    assert exported == 7 and run == ["nested", "leaf", "light", "init", "heavy"]
    from_import = __import__(package, fromlist=["heavy"]).heavy
    assert from_import is sys.modules[f"{package}.heavy"] and run.count("init") == 1 and run.count("light") == 1
    with pytest.raises(AttributeError, match="no attribute 'missing'"):
        parent.missing  # noqa: B018


def test_a_package_already_imported_or_absent_is_left_alone(package):
    module = importlib.import_module(package)
    assert not defer_package_init(package) and sys.modules[package] is module and module.EXPORTED == 7
    assert not defer_package_init("no_such_package_here") and "no_such_package_here" not in sys.modules
    # A module, not a package (and not imported yet): nothing deferred, nothing registered.
    assert f"{package}.nested.leaf" not in sys.modules
    assert not defer_package_init(f"{package}.nested.leaf") and f"{package}.nested.leaf" not in sys.modules


def test_the_background_thread_defers_before_it_imports(package):
    thread = start_background_imports((f"{package}.nested.leaf", "no_such_module_here"), (package, f"{package}.nested"))
    thread.join(60)
    run = importlib.import_module(f"{package}_record").RUN
    assert not thread.is_alive() and run == ["leaf"]  # neither the package's init nor the nested one ran


def test_the_process_exit_waits_for_an_import_still_running(tmp_path, monkeypatch):
    # An import cut off by the interpreter's teardown prints a traceback (a server stopped just
    # after ready): the engine process waits for the thread before it exits.
    (tmp_path / "slow_import_for_exit.py").write_text("import time\ntime.sleep(0.5)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "slow_import_for_exit", raising=False)
    thread = start_background_imports(("slow_import_for_exit",), ())
    assert thread.is_alive()
    wait_for_background_imports(30)
    assert not thread.is_alive() and sys.modules["slow_import_for_exit"].DONE
