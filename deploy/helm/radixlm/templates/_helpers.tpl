{{/*
Names and labels shared by every object of a release.
*/}}

{{/* The chart name, or nameOverride: at most 63 characters, as label values allow. */}}
{{- define "radixlm.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Object names: "<release>-<chart>", just "<release>" when it already holds the chart name. */}}
{{- define "radixlm.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "radixlm.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The labels that pick this release's pods: the Deployment, Service, PDB and ServiceMonitor selectors. */}}
{{- define "radixlm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "radixlm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radixlm.labels" -}}
helm.sh/chart: {{ include "radixlm.chart" . }}
{{ include "radixlm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: inference-server
app.kubernetes.io/part-of: radixlm
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The model folder the engine loads, as seen inside the container. */}}
{{- define "radixlm.modelPath" -}}
{{- if eq .Values.model.source "image" }}
{{- .Values.model.imagePath }}
{{- else }}
{{- .Values.model.mountPath }}
{{- end }}
{{- end }}

{{- define "radixlm.engineConfigName" -}}
{{- include "radixlm.fullname" . | trunc 56 | trimSuffix "-" }}-engine
{{- end }}

{{/* GPUs a pod asks for: engine.tensorParallelSize when one engine spans several (its ranks
take GPUs 0..N-1 of the pod), else gpu.count (one engine per GPU). */}}
{{- define "radixlm.gpuCount" -}}
{{- $tp := .Values.engine.tensorParallelSize | default 1 | int }}
{{- if gt $tp 1 }}{{ $tp }}{{ else }}{{ .Values.gpu.count | int }}{{ end }}
{{- end }}
