"""Validation and defaults of ValidatingAdmissionPolicies and their bindings, as v1.37's
(the checks that matter to a policy's author; each worded as the real server words it).

Policies: ``*/*`` with other resources in a rule (422), a ``reason`` other than
``Forbidden``, ``Invalid`` or ``RequestEntityTooLarge``, an expression that does not compile
(``compilation failed: ...``; cel-python's words after it), a validation without
expression. Bindings: ``policyName``, ``validationActions`` and
``paramRef.parameterNotFoundAction`` required; ``paramRef``'s
``name`` and ``selector`` mutually exclusive. Defaults: ``failurePolicy: Fail``,
``matchPolicy: Equivalent`` and empty namespace and object selectors.
"""

from __future__ import annotations

import json
from typing import Any

from kopf_reconcile.testing.emulated_apiserver import cel
from kopf_reconcile.testing.emulated_apiserver.errors import FieldError
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType

Object = dict[str, Any]

REASONS = ("Forbidden", "Invalid", "RequestEntityTooLarge")
ACTIONS = ("Deny", "Warn", "Audit")


def validate(resource: ResourceType, obj: Object) -> list[FieldError]:
    """Defaults ``obj`` in place, then lists what is wrong with it."""
    spec = obj.setdefault("spec", {})
    if not isinstance(spec, dict):
        return [FieldError.required("spec")]
    if resource.kind == "ValidatingAdmissionPolicy":
        spec.setdefault("failurePolicy", "Fail")
        _default_match(spec.get("matchConstraints"))
        return _policy_problems(spec)
    _default_match(spec.get("matchResources"))
    return _binding_problems(spec)


def _default_match(match: Any) -> None:
    if isinstance(match, dict):
        match.setdefault("namespaceSelector", {})
        match.setdefault("objectSelector", {})
        match.setdefault("matchPolicy", "Equivalent")


def _policy_problems(spec: Object) -> list[FieldError]:
    problems: list[FieldError] = []
    for index, rule in enumerate((spec.get("matchConstraints") or {}).get("resourceRules") or ()):
        resources = rule.get("resources") or []
        if "*/*" in resources and len(resources) > 1:
            problems.append(
                FieldError(
                    f"spec.matchConstraints.resourceRules[{index}].resources",
                    "FieldValueInvalid",
                    f"Invalid value: {json.dumps(resources, separators=(',', ':'))}: "
                    "if '*/*' is present, must not specify other resources",
                )
            )
    for index, condition in enumerate(spec.get("matchConditions") or ()):
        problems += _compiles(
            f"spec.matchConditions[{index}].expression", condition.get("expression")
        )
    for index, variable in enumerate(spec.get("variables") or ()):
        problems += _compiles(f"spec.variables[{index}].expression", variable.get("expression"))
    for index, validation in enumerate(spec.get("validations") or ()):
        path = f"spec.validations[{index}]"
        if not validation.get("expression"):
            problems.append(FieldError.required(f"{path}.expression"))
        else:
            problems += _compiles(f"{path}.expression", validation["expression"])
        if validation.get("messageExpression"):
            problems += _compiles(f"{path}.messageExpression", validation["messageExpression"])
        reason = validation.get("reason")
        if reason is not None and reason not in REASONS:
            problems.append(FieldError.not_supported(f"{path}.reason", reason, REASONS))
    failure = spec.get("failurePolicy")
    if failure not in ("Fail", "Ignore"):
        problems.append(FieldError.not_supported("spec.failurePolicy", failure, ("Fail", "Ignore")))
    return problems


def _compiles(path: str, expression: Any) -> list[FieldError]:
    try:
        cel.compile_expression(str(expression or ""))
    except cel.CelError as error:
        return [FieldError.invalid(path, expression, str(error))]
    return []


def _binding_problems(spec: Object) -> list[FieldError]:
    problems: list[FieldError] = []
    if not spec.get("policyName"):
        problems.append(FieldError.required("spec.policyName"))
    ref = spec.get("paramRef")
    if isinstance(ref, dict) and ref.get("name") and ref.get("selector") is not None:
        detail = "name and selector are mutually exclusive"
        problems.append(FieldError.forbidden("spec.paramRef.name", detail))
        problems.append(FieldError.forbidden("spec.paramRef.selector", detail))
    if isinstance(ref, dict) and not ref.get("parameterNotFoundAction"):
        problems.append(FieldError.required("spec.paramRef.parameterNotFoundAction"))
    actions = spec.get("validationActions")
    if not actions:
        problems.append(FieldError.required("spec.validationActions"))
    else:
        for index, action in enumerate(actions):
            if action not in ACTIONS:
                problems.append(
                    FieldError.not_supported(f"spec.validationActions[{index}]", action, ACTIONS)
                )
    return problems
