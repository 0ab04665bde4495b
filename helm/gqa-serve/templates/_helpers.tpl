{{/*
Chart name, truncated to the 63 characters DNS labels allow.
*/}}
{{- define "gqa-serve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Fully qualified app name; the release name alone when it already contains the chart name.
Kept to 54 characters so that the "-headless" suffix still fits a DNS label.
*/}}
{{- define "gqa-serve.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 54 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "gqa-serve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "gqa-serve.labels" -}}
helm.sh/chart: {{ include "gqa-serve.chart" . }}
{{ include "gqa-serve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "gqa-serve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "gqa-serve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "gqa-serve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "gqa-serve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
True (non-empty) when the pods run the cuda backend: GPU resources, node selector, image.
*/}}
{{- define "gqa-serve.gpu" -}}
{{- if eq .Values.server.backend "cuda" }}true{{ end }}
{{- end }}

{{- define "gqa-serve.image" -}}
{{- $variant := ternary "cuda" "cpu" (eq (include "gqa-serve.gpu" .) "true") }}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default (printf "%s-%s" .Chart.AppVersion $variant) .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
Seconds a pod may take to stop: the preStop sleep, the server's grace period, 1 s for the gRPC
server to stop. terminationGracePeriodSeconds must be longer, or streams are killed mid-drain.
*/}}
{{- define "gqa-serve.drainSeconds" -}}
{{- add (int .Values.preStopSleepSeconds) (ceil .Values.server.gracePeriodSeconds | int) 1 }}
{{- end }}

{{- define "gqa-serve.terminationGracePeriodSeconds" -}}
{{- $drain := include "gqa-serve.drainSeconds" . | int }}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds }}
{{- add $drain 15 }}
{{- else if le (int .Values.terminationGracePeriodSeconds) $drain }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be longer than the drain: preStopSleepSeconds + server.gracePeriodSeconds + 1 = %d" (int .Values.terminationGracePeriodSeconds) $drain) }}
{{- else }}
{{- int .Values.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/*
The service's settings as GQA_* variables (service/config.py reads exactly these). Integers go
through int64 so that YAML's float64 never prints as 2.147483648e+09.
*/}}
{{- define "gqa-serve.env" -}}
{{- $s := .Values.server -}}
- name: GQA_ADDRESS
  value: {{ printf "0.0.0.0:%d" (int .Values.ports.grpc) | quote }}
- name: GQA_METRICS_PORT
  value: {{ .Values.ports.metrics | int | quote }}
- name: GQA_BACKEND
  value: {{ $s.backend | quote }}
- name: GQA_DTYPE
  value: {{ $s.dtype | quote }}
{{- range $key, $env := dict "maxStreams" "GQA_MAX_STREAMS" "maxCacheBytes" "GQA_MAX_CACHE_BYTES" "maxCapacity" "GQA_MAX_CAPACITY" "maxLayers" "GQA_MAX_LAYERS" "maxHeads" "GQA_MAX_HEADS" "maxHeadDim" "GQA_MAX_HEAD_DIM" "maxBatchSize" "GQA_MAX_BATCH_SIZE" "maxMessageBytes" "GQA_MAX_MESSAGE_BYTES" "maxQueuedSteps" "GQA_MAX_QUEUED_STEPS" "inlineStepBytes" "GQA_INLINE_STEP_BYTES" "workers" "GQA_WORKERS" "torchThreads" "GQA_TORCH_THREADS" }}
- name: {{ $env }}
  value: {{ index $s $key | int64 | quote }}
{{- end }}
- name: GQA_IDLE_TIMEOUT_S
  value: {{ $s.idleTimeoutSeconds | toString | quote }}
- name: GQA_GRACE_PERIOD_S
  value: {{ $s.gracePeriodSeconds | toString | quote }}
- name: GQA_MAX_CONNECTION_AGE_S
  value: {{ $s.maxConnectionAgeSeconds | toString | quote }}
- name: GQA_LOG_LEVEL
  value: {{ $s.logLevel | quote }}
{{- if include "gqa-serve.gpu" . }}
- name: TRITON_CACHE_DIR
  value: /tmp/triton
{{- end }}
{{- if .Values.tls.enabled }}
- name: GQA_TLS_CERT_FILE
  value: /etc/gqa-serve/tls/tls.crt
- name: GQA_TLS_KEY_FILE
  value: /etc/gqa-serve/tls/tls.key
{{- if .Values.tls.clientAuth }}
- name: GQA_TLS_CLIENT_CA_FILE
  value: /etc/gqa-serve/tls/ca.crt
{{- end }}
- name: GQA_HEALTH_PORT
  value: {{ .Values.ports.health | int | quote }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The port kubelet probes: the gRPC port, or with TLS the plaintext health-only port (kubelet's
grpc probe cannot speak TLS).
*/}}
{{- define "gqa-serve.probePort" -}}
{{- if .Values.tls.enabled }}{{ .Values.ports.health }}{{ else }}{{ .Values.ports.grpc }}{{ end }}
{{- end }}
