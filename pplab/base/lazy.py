"""Floor 1, a package's submodules on first use.

A package's submodules are not its attributes until something imports them: after a bare
`import pplab`, `pplab.rank.mesh.apply_fsdp` would fail. Each floor's `__init__` takes its
`__getattr__` from here, so that a public module's one path works in both spellings, imported
(`from pplab.rank import mesh`) and reached (`pplab.rank.mesh`), loading only what is reached.
"""

import importlib
import importlib.util


def submodules_on_first_use(package: str):
    """A module `__getattr__` for `package` that imports `package.name` when `name` is one of its
    submodules, and says that the attribute does not exist otherwise."""

    def __getattr__(name: str):
        if not name.startswith("_") and importlib.util.find_spec(f"{package}.{name}") is not None:
            return importlib.import_module(f"{package}.{name}")
        raise AttributeError(f"module {package!r} has no attribute {name!r}")

    return __getattr__
