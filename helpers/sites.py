"""What counts as the user's code, for call sites and stack locations.

The doctor names the user's line: the first frame outside torch, accelerate, helpers (and the shims
that wrap their functions, typing_extensions's deprecation wrapper) and the standard library.
``helpers.scenarios`` (the catalog's scripts, run as users run them) and
``__main__`` (the script being run, a notebook cell) are user code.

Two callers know different things. The tracer, inside a rank, sees each frame's module name, so a
package the user installed into site-packages still counts as theirs. A stack read back from text
(faulthandler, py-spy) or a traceback has paths only: there a site-packages path cannot be told
from a third-party library and counts as library code.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

USER_PACKAGES = ("helpers.scenarios",)
# torch, accelerate, this package, and the shims that wrap a library's functions on its behalf:
# torch 2.13 marks all_gather_into_tensor and reduce_scatter_tensor deprecated with
# typing_extensions.deprecated, whose wrapper frame sits between the user's call and torch's
LIBRARY_PACKAGES = frozenset({"torch", "accelerate", "helpers", "typing_extensions", "wrapt", "deprecated",
                              "decorator"})
STDLIB = tuple({sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["platstdlib"]})
HELPERS_DIR = str(Path(__file__).resolve().parent) + "/"
SCENARIOS_DIR = HELPERS_DIR + "scenarios/"
INSTALLED = ("/site-packages/", "/dist-packages/")


def is_user_code(filename: str, module: str | None = None) -> bool:
    """Is code in ``filename`` (of module ``module`` when known) the user's own?"""
    if module is not None:
        return _user_module(module, filename)
    if filename.startswith(SCENARIOS_DIR) or "/helpers/scenarios/" in filename:
        return True
    if filename.startswith(("<", HELPERS_DIR)) or "/helpers/" in filename:
        return False  # this package, also in a folder kept on another machine
    if installed(filename):
        return False  # installed libraries; a clone (/home/me/accelerate/examples/...) is the user's
    return not filename.startswith(STDLIB)


def installed(filename: str) -> bool:
    """Is the file an installed package's (under site-packages or dist-packages)?"""
    return any(part in filename for part in INSTALLED)


def installed_package(filename: str) -> str | None:
    """The top-level package (or lone module) of an installed file; None for any other file."""
    path = filename.replace("\\", "/")
    marker = next((part for part in INSTALLED if part in path), None)
    return None if marker is None else path.split(marker, 1)[1].split("/", 1)[0].removesuffix(".py") or None


def _user_module(module: str, filename: str) -> bool:
    if filename.startswith(HELPERS_DIR) and not filename.startswith(SCENARIOS_DIR):
        return False  # this package, also its entry points run as __main__ (python -m helpers.doctor)
    if module == "__main__" or module.startswith(USER_PACKAGES):
        return True
    if module.split(".")[0] in LIBRARY_PACKAGES or filename.startswith("<frozen"):
        return False
    return not (filename.startswith(STDLIB) and "site-packages" not in filename)
