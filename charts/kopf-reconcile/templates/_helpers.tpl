{{- define "kopf-reconcile.fullname" -}}
{{- printf "%s" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kopf-reconcile.labels" -}}
app.kubernetes.io/name: kopf-reconcile
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kopf-reconcile.selector" -}}
app.kubernetes.io/name: kopf-reconcile
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* policy/v1 PodDisruptionBudget from 1.21; policy/v1beta1 before. */}}
{{- define "kopf-reconcile.pdbApiVersion" -}}
{{- if or (.Capabilities.APIVersions.Has "policy/v1/PodDisruptionBudget") (semverCompare ">=1.21-0" .Capabilities.KubeVersion.Version) -}}
policy/v1
{{- else -}}
policy/v1beta1
{{- end -}}
{{- end -}}

{{- define "kopf-reconcile.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The ServiceAccount of the test hook: it reads the leases and the operator's pods. */}}
{{- define "kopf-reconcile.testName" -}}
{{- printf "%s-test" (include "kopf-reconcile.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}
