"""The CRDs' CEL rules (`x-kubernetes-validations`), evaluated by cel-python as the API server
evaluates them on create. cel-python is imported on the first rule a manifest reaches (~0.4 s,
its grammar), not by every check.

cel-python has CEL's standard functions and macros, not Kubernetes' own libraries (`isURL`,
`quantity`, the extended strings' `split`, `lowerAscii`, ...): a rule that calls one is not
evaluated, and unknown_cel_rules (raylane.k8s.schema) names it, so that a KubeRay release that
brings one fails tests/unit/test_k8s_check.py instead of passing unchecked. KubeRay 1.7.0's rules
need none."""

from __future__ import annotations

import functools
import re
from typing import Any

MACROS = {"has", "all", "exists", "exists_one", "map", "filter", "dyn"}


def on_update(rule: str) -> bool:
    """A transition rule: it reads the stored object (`oldSelf`), which a create does not have,
    so the API server skips it on create."""
    return re.search(r"\boldSelf\b", rule) is not None


def called(tree: Any) -> set[str]:
    """The functions and methods a parsed rule calls."""
    return {
        str(child)
        for node in tree.iter_subtrees()
        if node.data in ("ident_arg", "member_dot_arg")
        for child in node.children
        if getattr(child, "type", None) == "IDENT"
    }


@functools.cache
def program(rule: str) -> Any:
    """The rule compiled, or None where cel-python cannot parse it or lacks a function it calls."""
    import celpy
    from celpy.evaluation import base_functions

    environment = celpy.Environment()
    try:
        tree = environment.compile(rule)
    except celpy.CELParseError:
        return None
    if called(tree) - MACROS - set(base_functions):
        return None
    return environment.program(tree)


def holds(rule: str, instance: Any) -> bool:
    """False only where the rule evaluates to false. A rule that errs on the value (a field of the
    wrong type) passes here: the schema's type check names that value instead."""
    import celpy

    compiled = None if on_update(rule) else program(rule)
    if compiled is None:
        return True
    try:
        result = compiled.evaluate({"self": celpy.json_to_cel(instance)})
    except celpy.CELEvalError:
        return True
    return not isinstance(result, celpy.celtypes.BoolType) or bool(result)
