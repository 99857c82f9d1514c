"""SGLang's own HTTP contract, read from the installed sglang package (``pip install --no-deps
sglang==0.5.23``; ``make setup`` does it), without importing sglang or its heavy dependencies.

- ``api_types()``: ``sglang/api/v1/api_types.py``, the generated JSON contract (msgspec Structs:
  ``GenerateRequest``, ``GenerateResponse``, ``GenerateMetaInfo``, ``WeightVersionSpan``, ...),
  loaded by file path; it needs only msgspec.
- ``check_request(cls, body)``: a control endpoint's JSON body against a request class of
  ``sglang/srt/managers/io_struct.py`` (``UpdateWeightFromDiskReqInput``, ...), read as data with
  ``ast``: every key must be a field, every field without a default present, each value of the
  field's annotated type.
"""

from __future__ import annotations

import ast
import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

SGLANG_VERSION = "0.5.23"

# /pull_weights is not in 0.5.23. Its request, PullWeightsReqInput, as defined in the SGLang
# revisions that ship python/sglang/srt/weight_sync/local_checkpoint.py (sgl-project/sglang
# 81da301, modal-projects/sglang 44c81a6 .. 1d22906): these three required fields (1d22906 adds
# an optional ``prepare``, which the adapter leaves at its default).
PULL_WEIGHTS_FIELDS = "local_checkpoint_dir: str\nsource_dir: str\ntarget_version: int\n"


@functools.cache
def sglang_dir() -> Path:
    spec = importlib.util.find_spec("sglang")  # finds the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"sglang is not installed: pip install --no-deps sglang=={SGLANG_VERSION} (make setup)")
    return Path(next(iter(spec.submodule_search_locations)))


@functools.cache
def api_types() -> ModuleType:
    path = sglang_dir() / "api" / "v1" / "api_types.py"
    spec = importlib.util.spec_from_file_location("sglang_api_v1_types", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # msgspec resolves the Structs' annotations through it
    spec.loader.exec_module(module)
    return module


def _classes(source: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.parse(source).body if isinstance(n, ast.ClassDef)}


@functools.cache
def _io_struct() -> dict[str, ast.ClassDef]:
    classes = _classes((sglang_dir() / "srt" / "managers" / "io_struct.py").read_text())
    classes["PullWeightsReqInput"] = _classes(
        "class PullWeightsReqInput(BaseReq, kw_only=True):\n"
        + "".join(f"    {f}" for f in PULL_WEIGHTS_FIELDS.splitlines(True))
    )["PullWeightsReqInput"]
    return classes


def request_fields(name: str) -> dict[str, tuple[ast.expr, bool]]:
    """A request class's fields, its bases' first: name -> (annotation, has a default)."""
    classes = _io_struct()
    cls = classes[name]
    fields: dict[str, tuple[ast.expr, bool]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            fields.update(request_fields(base.id))
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            fields[node.target.id] = (node.annotation, node.value is not None)
    return fields


def _matches(value: Any, ann: ast.expr) -> bool:
    if isinstance(ann, ast.Constant) and isinstance(ann.value, str):  # a string annotation
        return _matches(value, ast.parse(ann.value, mode="eval").body)
    if isinstance(ann, ast.Name):
        simple = {"str": str, "bool": bool, "dict": dict, "list": list}
        if ann.id == "Any":
            return True
        if ann.id == "int":
            return isinstance(value, int) and not isinstance(value, bool)
        if ann.id == "float":
            return isinstance(value, int | float) and not isinstance(value, bool)
        return ann.id in simple and isinstance(value, simple[ann.id])
    if isinstance(ann, ast.Subscript) and isinstance(ann.value, ast.Name):
        kind, args = ann.value.id, ann.slice
        items = list(args.elts) if isinstance(args, ast.Tuple) else [args]
        if kind == "Optional":
            return value is None or _matches(value, items[0])
        if kind == "Union":
            return any(_matches(value, a) for a in items)
        if kind == "Literal":
            return any(isinstance(a, ast.Constant) and a.value == value for a in items)
        if kind in ("List", "list"):
            return isinstance(value, list) and all(_matches(v, items[0]) for v in value)
        if kind in ("Dict", "dict"):
            return isinstance(value, dict) and all(
                _matches(k, items[0]) and _matches(v, items[1]) for k, v in value.items()
            )
    raise AssertionError(f"cannot check against annotation {ast.unparse(ann)}")


def check_request(name: str, body: Any) -> None:
    """Assert that ``body`` is a valid JSON body for io_struct's ``name``."""
    fields = request_fields(name)
    assert isinstance(body, dict), f"{name}: body must be a JSON object, got {body!r}"
    unknown = sorted(set(body) - set(fields))
    assert not unknown, f"{name} has no fields {unknown} (SGLang {SGLANG_VERSION} would ignore them)"
    missing = sorted(n for n, (_, has_default) in fields.items() if not has_default and n not in body)
    assert not missing, f"{name} requires {missing}"
    for key, value in body.items():
        ann = fields[key][0]
        assert _matches(value, ann), f"{name}.{key} is {ast.unparse(ann)}, got {value!r}"
