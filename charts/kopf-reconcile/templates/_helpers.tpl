{{/* The app's name (the app.kubernetes.io/name label): nameOverride, else the chart's. */}}
{{- define "kopf-reconcile.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The objects' base name: fullnameOverride; else the release's name, followed by
nameOverride when one is given and the release's name does not hold it already. */}}
{{- define "kopf-reconcile.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else if and .Values.nameOverride (not (contains .Values.nameOverride .Release.Name)) -}}
{{- printf "%s-%s" .Release.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* The operator's ServiceAccount: made by the chart (serviceAccount.create) or given. */}}
{{- define "kopf-reconcile.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kopf-reconcile.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- required "serviceAccount.name is required with serviceAccount.create=false: the ServiceAccount the operator runs as" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kopf-reconcile.labels" -}}
app.kubernetes.io/name: {{ include "kopf-reconcile.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "kopf-reconcile.selector" -}}
app.kubernetes.io/name: {{ include "kopf-reconcile.name" . }}
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
