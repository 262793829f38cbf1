{{/*
The OpenAI-compatible API (radixlm-openai, a sidecar of every server pod) and the router in
front of the pods (sglang-router). Kept apart from the server's own templates.
*/}}

{{/* The sidecar: the OpenAI API on openai.port, a client of tritonserver's gRPC port. */}}
{{- define "radixlm.openaiContainer" -}}
- name: openai
  image: "{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}"
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command:
    - radixlm-openai
    - --grpc-url=localhost:8001
    - --host=0.0.0.0
    - --port={{ .Values.openai.port | int }}
    - --model={{ .Values.model.tritonModelName }}
    - --served-model-name={{ .Values.openai.servedModelName | default .Values.model.tritonModelName }}
    {{- with .Values.openai.defaultMaxTokens }}
    - --default-max-tokens={{ . | int }}
    {{- end }}
    {{- if .Values.openai.tokenizerRoutes }}
    - --tokenizer={{ include "radixlm.modelPath" . }}
    {{- end }}
  {{- if and .Values.openai.tokenizerRoutes (ne .Values.model.source "image") }}
  # the model folder's tokenizer files, for /tokenize and its kin (read-only, as the
  # server container mounts it)
  volumeMounts:
    - name: model
      mountPath: {{ .Values.model.mountPath }}
      readOnly: true
      {{- with .Values.model.subPath }}
      subPath: {{ . }}
      {{- end }}
  {{- end }}
  ports:
    - name: openai
      containerPort: {{ .Values.openai.port | int }}
      protocol: TCP
  # /health is ready only while tritonserver serves the model, so a pod is in the router's
  # rotation (the router takes Ready pods) only when both containers can answer.
  readinessProbe:
    httpGet:
      path: /health
      port: openai
    periodSeconds: 5
    timeoutSeconds: 5
    failureThreshold: 3
  livenessProbe:
    tcpSocket:
      port: openai
    periodSeconds: 15
    failureThreshold: 4
  {{- with .Values.openai.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end }}

{{- define "radixlm.routerName" -}}
{{- include "radixlm.fullname" . | trunc 56 | trimSuffix "-" }}-router
{{- end }}

{{/* The router's own pods: another name label, so the server pods' selectors never match them. */}}
{{- define "radixlm.routerSelectorLabels" -}}
app.kubernetes.io/name: {{ include "radixlm.name" . }}-router
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "radixlm.routerLabels" -}}
helm.sh/chart: {{ include "radixlm.chart" . }}
{{ include "radixlm.routerSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/part-of: radixlm
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}
