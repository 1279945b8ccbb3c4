"""User code named by import path, `package.module:name` (custom rewards, environments), loaded
with errors that name the setting, the path and the module."""
from __future__ import annotations

import importlib
from typing import Any, Callable


def load_by_path(setting: str, spec: str, form: str, also: str = "") -> Callable[..., Any]:
    """The callable `spec` names. `form` is what it names ("function", "Class"), for the errors;
    `also`, what else the setting accepts (" nor an http(s) URL")."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ValueError(f"{setting}: {spec!r} is not 'package.module:{form}'{also}")
    try:
        module = importlib.import_module(module_name)
    except Exception as error:  # an import error of any kind inside the user's module
        raise ValueError(f"{setting}: cannot import module {module_name!r} (from {spec!r}): "
                         f"{type(error).__name__}: {error}") from None
    found = getattr(module, attribute, None)
    if not callable(found):
        raise ValueError(f"{setting}: module {module_name!r} ({module.__file__}) has no {form.lower()} "
                         f"{attribute!r} (from {spec!r})")
    return found
