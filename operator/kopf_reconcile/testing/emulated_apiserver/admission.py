"""ValidatingAdmissionPolicies, enforced as kube-apiserver v1.37 enforces them.

Every create, update (PUT, every PATCH type, server-side apply; subresources such as
``/status`` too) and delete of any resource (the policies and bindings themselves excepted,
as the real server exempts them), dry runs included, is checked after the object's own
validation and before it is stored, for each policy matched by its ``matchConstraints``
(``resourceRules`` with ``*``, ``*/*``, ``x/status``, operations, scope and
``resourceNames``; ``excludeResourceRules``; ``namespaceSelector`` and ``objectSelector``)
and each binding of it matched by its ``matchResources``:

1. params first (``paramKind`` with the binding's ``paramRef``: ``name`` or ``selector``, in
   ``paramRef.namespace`` or else the request's namespace), read live from the store; none
   found with ``parameterNotFoundAction: Deny`` denies even a request the match conditions
   would skip, as the params are collected before them; ``Allow``: nothing is evaluated;
2. per param, ``matchConditions`` (any false: skipped; an error: the failure policy);
3. ``variables`` (lazily) and ``validations``: a false result is a decision worded by
   ``messageExpression``, else ``message``, else ``failed expression: <expression>``, with
   its ``reason`` (default ``Invalid``) as the HTTP status; an error goes by the failure
   policy (``Fail``: a denial reasoned ``Invalid``; ``Ignore``: admitted);
4. the binding's ``validationActions``: ``Deny`` (the first denial answers the request),
   ``Warn`` (a ``Warning`` header), ``Audit`` (the audit annotation
   ``validation.policy.admission.k8s.io/validation_failure``).

Expressions are compiled once per policy text (:mod:`.cel`). Requests of a cluster with no
binding cost one dictionary lookup. ``matchPolicy: Equivalent`` sees no other version of a
resource, ``auditAnnotations`` and the ``authorizer`` CEL library are not emulated.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kopf_reconcile.testing.emulated_apiserver import cel, errors
from kopf_reconcile.testing.emulated_apiserver.controllers import NAMESPACES_KEY
from kopf_reconcile.testing.emulated_apiserver.resources import ResourceType

if TYPE_CHECKING:
    from kopf_reconcile.testing.emulated_apiserver.identity import UserInfo
    from kopf_reconcile.testing.emulated_apiserver.registry import ResourceAPI

Object = dict[str, Any]

GROUP = "admissionregistration.k8s.io"
POLICIES_KEY = (GROUP, "validatingadmissionpolicies")
BINDINGS_KEY = (GROUP, "validatingadmissionpolicybindings")
#: Not subject to admission policies (kube-apiserver exempts its admission configuration).
EXEMPT_KEYS = frozenset(
    {
        POLICIES_KEY,
        BINDINGS_KEY,
        (GROUP, "validatingwebhookconfigurations"),
        (GROUP, "mutatingwebhookconfigurations"),
        (GROUP, "mutatingadmissionpolicies"),
        (GROUP, "mutatingadmissionpolicybindings"),
    }
)
VALIDATION_FAILURE_ANNOTATION = "validation.policy.admission.k8s.io/validation_failure"
#: The HTTP status of each reason a validation may give (kube-apiserver's reasonToCode).
CODES = {"Forbidden": 403, "Unauthorized": 401, "RequestEntityTooLarge": 413, "Invalid": 422}


@dataclass(frozen=True)
class AdmissionRequest:
    """One write as admission sees it."""

    operation: str  # CREATE, UPDATE, DELETE
    resource: ResourceType
    subresource: str
    namespace: str
    name: str
    object: Object | None
    old_object: Object | None
    user: UserInfo
    dry_run: bool


@dataclass
class Outcome:
    """What admission adds to a request it lets through: warnings and audit annotations."""

    warnings: list[str] = field(default_factory=list)
    annotations: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class _Denial:
    policy: str
    binding: str | None
    message: str
    reason: str = "Invalid"


@dataclass(frozen=True)
class _Validation:
    program: cel.Program | None
    expression: str
    message: str
    message_program: cel.Program | None
    reason: str


@dataclass(frozen=True)
class _CompiledPolicy:
    """A policy's expressions, compiled once for its resourceVersion."""

    match_conditions: tuple[cel.Program, ...]
    variables: tuple[tuple[str, cel.Program], ...]
    validations: tuple[_Validation, ...]
    error: str | None  # a compilation error, reported by the failure policy


class Admission:
    """The ValidatingAdmissionPolicy plugin over one ResourceAPI's store."""

    def __init__(self, api: ResourceAPI) -> None:
        self._api = api
        self._compiled: dict[tuple[str, str], _CompiledPolicy] = {}

    def validate(self, request: AdmissionRequest, outcome: Outcome) -> None:
        """Raise the denial (a Status error), or record warnings and annotations."""
        store = self._api.store
        if not store.count(BINDINGS_KEY) or request.resource.storage_key in EXEMPT_KEYS:
            return
        bindings_of: dict[str, list[Object]] = {}
        for binding in store.items(BINDINGS_KEY):
            policy_name = str((binding.get("spec") or {}).get("policyName") or "")
            bindings_of.setdefault(policy_name, []).append(binding)
        denials: list[_Denial] = []
        failures: list[dict[str, Any]] = []
        for policy in store.items(POLICIES_KEY):
            bindings = bindings_of.get(policy["metadata"]["name"])
            if not bindings or not self._matches(policy.get("spec") or {}, request):
                continue
            for binding in bindings:
                self._evaluate(
                    policy, binding, request, denials=denials, failures=failures, outcome=outcome
                )
        if failures:
            outcome.annotations[VALIDATION_FAILURE_ANNOTATION] = json.dumps(
                failures, separators=(",", ":")
            )
        if denials:
            raise _denied(request, denials[0])

    # Matching.

    def _matches(self, criteria: Object, request: AdmissionRequest) -> bool:
        constraints = criteria.get("matchConstraints") or criteria.get("matchResources") or {}
        if not _selector_matches(
            constraints.get("namespaceSelector"), self._namespace_labels, request
        ):
            return False
        if not _object_selector_matches(constraints.get("objectSelector"), request):
            return False
        if any(
            _rule_matches(rule, request) for rule in constraints.get("excludeResourceRules") or ()
        ):
            return False
        rules = constraints.get("resourceRules") or ()
        return not rules or any(_rule_matches(rule, request) for rule in rules)

    def _namespace_labels(self, request: AdmissionRequest) -> dict[str, str]:
        if request.resource.storage_key == NAMESPACES_KEY:
            if request.operation in ("CREATE", "UPDATE") and not request.subresource:
                return dict(((request.object or {}).get("metadata") or {}).get("labels") or {})
            namespace = self._api.store.get(NAMESPACES_KEY, "", request.name)
        else:
            namespace = self._api.store.get(NAMESPACES_KEY, "", request.namespace)
        return dict(((namespace or {}).get("metadata") or {}).get("labels") or {})

    # Evaluating.

    def _evaluate(
        self,
        policy: Object,
        binding: Object,
        request: AdmissionRequest,
        *,
        denials: list[_Denial],
        failures: list[dict[str, Any]],
        outcome: Outcome,
    ) -> None:
        spec = policy.get("spec") or {}
        binding_spec = binding.get("spec") or {}
        policy_name = policy["metadata"]["name"]
        binding_name = binding["metadata"]["name"]
        fail = (spec.get("failurePolicy") or "Fail") == "Fail"
        if binding_spec.get("matchResources") and not self._matches(binding_spec, request):
            return
        try:
            params = self._params(spec.get("paramKind"), binding_spec.get("paramRef"), request)
        except _ConfigurationError as error:
            if fail:
                message = f"failed to configure binding: {error}"
                denials.append(_Denial(policy_name, binding_name, message))
            return
        compiled = self._compile(policy)
        namespace_object = None
        if request.namespace and request.resource.storage_key != NAMESPACES_KEY:
            namespace_object = self._api.store.get(NAMESPACES_KEY, "", request.namespace)
        actions = binding_spec.get("validationActions") or ()
        for param in params:
            activation = _activation(request, param, namespace_object, compiled.variables)
            decisions = _decide(compiled, fail, activation)
            for index, (message, reason) in decisions:
                if "Deny" in actions:
                    denials.append(_Denial(policy_name, binding_name, message, reason))
                if "Warn" in actions:
                    outcome.warnings.append(
                        f"Validation failed for ValidatingAdmissionPolicy '{policy_name}' "
                        f"with binding '{binding_name}': {message}"
                    )
                if "Audit" in actions:
                    failures.append(
                        {
                            "message": message,
                            "policy": policy_name,
                            "binding": binding_name,
                            "expressionIndex": index,
                            "validationActions": list(actions),
                        }
                    )

    def _params(
        self, kind: Object | None, ref: Object | None, request: AdmissionRequest
    ) -> list[Object | None]:
        if not kind or not ref:
            return [None]
        group, _, version = str(kind.get("apiVersion") or "").rpartition("/")
        resource = next(
            (
                r
                for r in self._api.registry.in_group_version(group, version)
                if r.kind == kind.get("kind")
            ),
            None,
        )
        if resource is None:
            raise _ConfigurationError(
                f"paramKind kind `{kind.get('apiVersion')}, Kind={kind.get('kind')}` not known"
            )
        namespace = ""
        if resource.namespaced:
            namespace = str(ref.get("namespace") or request.namespace)
            if not namespace:
                raise _ConfigurationError(
                    "cannot use namespaced paramRef in policy binding that matches "
                    "cluster-scoped resources"
                )
        elif ref.get("namespace"):
            raise _ConfigurationError(
                "paramRef.namespace must not be provided for a cluster-scoped `paramKind`"
            )
        store = self._api.store
        params: list[Object | None]
        if ref.get("name"):
            found = store.get(resource.storage_key, namespace, str(ref["name"]))
            params = [found] if found is not None else []
        else:
            selector = ref.get("selector") or {}
            params = [
                obj
                for obj in store.items(resource.storage_key, namespace if namespace else None)
                if _labels_match(selector, (obj["metadata"].get("labels") or {}))
            ]
        if not params and ref.get("parameterNotFoundAction") == "Deny":
            raise _ConfigurationError(
                "no params found for policy binding with `Deny` parameterNotFoundAction"
            )
        return params

    def _compile(self, policy: Object) -> _CompiledPolicy:
        key = (policy["metadata"].get("uid", ""), policy["metadata"].get("resourceVersion", ""))
        compiled = self._compiled.get(key)
        if compiled is None:
            if len(self._compiled) > 256:
                self._compiled.clear()  # stale versions go; live ones compile again
            compiled = self._compiled[key] = _compile(policy.get("spec") or {})
        return compiled


class _ConfigurationError(Exception):
    pass


def _compile(spec: Object) -> _CompiledPolicy:
    error: str | None = None

    def program(expression: str) -> cel.Program | None:
        nonlocal error
        try:
            return cel.compile_expression(expression)
        except cel.CelError as failure:
            error = error or str(failure)
            return None

    conditions = tuple(
        p for c in spec.get("matchConditions") or () if (p := program(str(c.get("expression", ""))))
    )
    variables = tuple(
        (str(v.get("name")), p)
        for v in spec.get("variables") or ()
        if (p := program(str(v.get("expression", ""))))
    )
    validations = tuple(
        _Validation(
            program=program(str(v.get("expression", ""))),
            expression=str(v.get("expression", "")),
            message=str(v.get("message") or ""),
            message_program=program(str(v["messageExpression"]))
            if v.get("messageExpression")
            else None,
            reason=str(v.get("reason") or "Invalid"),
        )
        for v in spec.get("validations") or ()
    )
    return _CompiledPolicy(conditions, variables, validations, error)


def _decide(
    compiled: _CompiledPolicy, fail: bool, activation: dict[str, Any]
) -> list[tuple[int, tuple[str, str]]]:
    """The failed validations: (index, (message, reason)); empty when admitted."""
    if compiled.error is not None:
        return [(0, (compiled.error, "Invalid"))] if fail else []
    errors_seen: list[str] = []
    for condition in compiled.match_conditions:
        try:
            matched = condition.evaluate(activation)
        except cel.CelError as error:
            errors_seen.append(_resulted_in_error(condition.expression, error))
            continue
        if cel.to_python(matched) is not True:
            return []
    if errors_seen:
        if not fail:
            return []
        message = errors_seen[0] if len(errors_seen) == 1 else "[" + ", ".join(errors_seen) + "]"
        return [(0, (message, "Invalid"))]
    decisions: list[tuple[int, tuple[str, str]]] = []
    for index, validation in enumerate(compiled.validations):
        assert validation.program is not None  # compiled.error is None
        try:
            result = validation.program.evaluate(activation)
        except cel.CelError as error:
            if fail:
                message = _resulted_in_error(validation.expression, error)
                decisions.append((index, (message, "Invalid")))
            continue
        if cel.to_python(result) is True:
            continue
        decisions.append((index, (_message(validation, activation), validation.reason)))
    return decisions


def _message(validation: _Validation, activation: dict[str, Any]) -> str:
    message = ""
    if validation.message_program is not None:
        try:
            value = cel.to_python(validation.message_program.evaluate(activation))
        except cel.CelError:
            value = ""
        if isinstance(value, str):
            message = value.strip()
            if "\n" in message or len(message) > 5 * 1024:
                message = ""
    if not message and validation.message:
        message = validation.message.strip()
    return message or f"failed expression: {validation.expression.strip()}"


def _resulted_in_error(expression: str, error: cel.CelError) -> str:
    return f"expression '{expression}' resulted in error: {error}"


def _activation(
    request: AdmissionRequest,
    param: Object | None,
    namespace: Object | None,
    variables: Iterable[tuple[str, cel.Program]],
) -> dict[str, Any]:
    activation: dict[str, Any] = {
        "object": cel.to_cel(request.object),
        "oldObject": cel.to_cel(request.old_object),
        "request": cel.to_cel(_request_document(request)),
        "params": cel.to_cel(param),
        "namespaceObject": cel.to_cel(namespace),
    }
    thunks: dict[str, Callable[[], Any]] = {}
    for name, program in variables:
        thunks[name] = _thunk(program, activation)
    activation["variables"] = cel.LazyVariables(thunks)
    return activation


def _thunk(program: cel.Program, activation: dict[str, Any]) -> Callable[[], Any]:
    return lambda: program.evaluate(activation)


def _request_document(request: AdmissionRequest) -> Object:
    resource = request.resource
    kind = {"group": resource.group, "version": resource.version, "kind": resource.kind}
    gvr = {"group": resource.group, "version": resource.version, "resource": resource.plural}
    name = request.name or ((request.object or {}).get("metadata") or {}).get("name", "")
    document: Object = {
        "uid": str(uuid.uuid4()),
        "kind": kind,
        "resource": gvr,
        "requestKind": kind,
        "requestResource": gvr,
        "operation": request.operation,
        "userInfo": request.user.as_json(),
        "dryRun": request.dry_run,
    }
    if request.subresource:
        document["subResource"] = document["requestSubResource"] = request.subresource
    if name:
        document["name"] = name
    if request.namespace:
        document["namespace"] = request.namespace
    return document


def _denied(request: AdmissionRequest, denial: _Denial) -> errors.ApiError:
    if denial.binding is None:
        message = f"ValidatingAdmissionPolicy '{denial.policy}' denied request: {denial.message}"
    else:
        message = (
            f"ValidatingAdmissionPolicy '{denial.policy}' with binding '{denial.binding}' "
            f"denied request: {denial.message}"
        )
    resource = request.resource
    name = request.name or ((request.object or {}).get("metadata") or {}).get("name", "")
    target = resource.target(name)
    prefix = f'{target.group_resource} "{name}"' if name else target.group_resource
    details: Object = {}
    if name:
        details["name"] = name
    if resource.group:
        details["group"] = resource.group
    details["kind"] = resource.plural
    details["causes"] = [{"message": message}]
    code = CODES.get(denial.reason, 500)
    return errors.ApiError(code, f"{prefix} is forbidden: {message}", denial.reason, details)


# Selectors and rules.


def _rule_matches(rule: Object, request: AdmissionRequest) -> bool:
    resource = request.resource
    operations = rule.get("operations") or ()
    if "*" not in operations and request.operation not in operations:
        return False
    if not _any_or(rule.get("apiGroups"), resource.group):
        return False
    if not _any_or(rule.get("apiVersions"), resource.version):
        return False
    scope = rule.get("scope") or "*"
    if (scope == "Cluster" and resource.namespaced) or (
        scope == "Namespaced" and not resource.namespaced
    ):
        return False
    if not any(
        _resource_matches(str(wanted), resource.plural, request.subresource)
        for wanted in rule.get("resources") or ()
    ):
        return False
    names = rule.get("resourceNames") or ()
    return not names or request.name in names


def _resource_matches(wanted: str, plural: str, subresource: str) -> bool:
    if wanted == "*/*":
        return True
    name, slash, sub = wanted.partition("/")
    if not slash:
        return name in ("*", plural) and not subresource
    return name in ("*", plural) and sub in ("*", subresource) and bool(subresource)


def _any_or(allowed: Any, value: str) -> bool:
    return "*" in (allowed or ()) or value in (allowed or ())


def _selector_matches(
    selector: Object | None,
    labels_of: Callable[[AdmissionRequest], dict[str, str]],
    request: AdmissionRequest,
) -> bool:
    if not request.namespace and request.resource.storage_key != NAMESPACES_KEY:
        return True
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return True
    return _labels_match(selector, labels_of(request))


def _object_selector_matches(selector: Object | None, request: AdmissionRequest) -> bool:
    if not selector or not (selector.get("matchLabels") or selector.get("matchExpressions")):
        return True
    return any(
        obj is not None and _labels_match(selector, (obj.get("metadata") or {}).get("labels") or {})
        for obj in (request.object, request.old_object)
    )


def _labels_match(selector: Object, labels: dict[str, str]) -> bool:
    """A LabelSelector (``matchLabels`` and ``matchExpressions``) against labels."""
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expression in selector.get("matchExpressions") or ():
        key, operator = expression.get("key"), expression.get("operator")
        values = expression.get("values") or ()
        if operator == "In" and labels.get(key) not in values:
            return False
        if operator == "NotIn" and key in labels and labels[key] in values:
            return False
        if operator == "Exists" and key not in labels:
            return False
        if operator == "DoesNotExist" and key in labels:
            return False
    return True
