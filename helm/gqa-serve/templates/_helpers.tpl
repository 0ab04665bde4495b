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
Bytes from a number or a Kubernetes quantity ("8Gi", "512Mi", "1G", "1.5Gi", 2147483648), as
a decimal integer: what the server's size settings accept, whatever their own unit parsing.
Call with (list $value "values.path") so a bad value names its setting.
*/}}
{{- define "gqa-serve.bytes" -}}
{{- $value := index . 0 -}}
{{- $where := index . 1 -}}
{{- $text := "" -}}
{{- if or (kindIs "float64" $value) (kindIs "int64" $value) (kindIs "int" $value) -}}
{{- $text = printf "%d" (int64 $value) -}}
{{- else -}}
{{- $text = toString $value | trim -}}
{{- end -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" $text -}}
{{- $suffix := trimPrefix $number $text -}}
{{- $units := dict "" 1 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 -}}
{{- if or (not $number) (not (hasKey $units $suffix)) -}}
{{- fail (printf "%s: %q is not a byte size (bytes, or a quantity such as 8Gi, 512Mi, 1G)" $where $text) -}}
{{- end -}}
{{- if contains "." $number -}}
{{- printf "%d" (mulf (float64 $number) (index $units $suffix) | int64) -}}
{{- else -}}
{{- printf "%d" (mul (int64 $number) (index $units $suffix)) -}}
{{- end -}}
{{- end }}

{{/*
Checks across values that the schema cannot express; included once by the Deployment.
*/}}
{{- define "gqa-serve.validate" -}}
{{- $s := .Values.server -}}
{{- $message := include "gqa-serve.bytes" (list $s.maxMessageBytes "server.maxMessageBytes") | int64 -}}
{{- if or (lt $message 1024) (gt $message 2147483647) -}}
{{- fail (printf "server.maxMessageBytes: %d bytes is outside 1Ki .. 2Gi-1 (gRPC's message size limit)" $message) -}}
{{- end -}}
{{- $cache := include "gqa-serve.bytes" (list $s.maxCacheBytes "server.maxCacheBytes") | int64 -}}
{{- if lt $cache 1 -}}
{{- fail "server.maxCacheBytes: must be positive" -}}
{{- end -}}
{{- $limit := dig "limits" "memory" "" (.Values.resources | default dict) -}}
{{- if and $limit (not (include "gqa-serve.gpu" .)) -}}
{{- $limitBytes := include "gqa-serve.bytes" (list $limit "resources.limits.memory") | int64 -}}
{{- $headroom := include "gqa-serve.bytes" (list .Values.memoryHeadroom "memoryHeadroom") | int64 -}}
{{- if gt (add $cache $headroom) $limitBytes -}}
{{- fail (printf "server.maxCacheBytes (%v = %d bytes) + memoryHeadroom (%v = %d bytes) does not fit in resources.limits.memory (%v = %d bytes): the pod would be OOM-killed before the cache budget refuses a stream. Lower server.maxCacheBytes or raise resources.limits.memory." $s.maxCacheBytes $cache .Values.memoryHeadroom $headroom $limit $limitBytes) -}}
{{- end -}}
{{- end -}}
{{- end }}

{{/*
The service's settings as GQA_* variables (service/config.py reads exactly these). Integers go
through int64 so that YAML's float64 never prints as 2.147483648e+09; byte sizes through
gqa-serve.bytes.
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
{{- range $key, $env := dict "maxStreams" "GQA_MAX_STREAMS" "maxCapacity" "GQA_MAX_CAPACITY" "maxLayers" "GQA_MAX_LAYERS" "maxHeads" "GQA_MAX_HEADS" "maxHeadDim" "GQA_MAX_HEAD_DIM" "maxBatchSize" "GQA_MAX_BATCH_SIZE" "maxQueuedSteps" "GQA_MAX_QUEUED_STEPS" "workers" "GQA_WORKERS" "torchThreads" "GQA_TORCH_THREADS" "kernelThreads" "GQA_KERNEL_THREADS" "batchMaxDelayMicroseconds" "GQA_BATCH_MAX_DELAY_US" "batchMaxSteps" "GQA_BATCH_MAX_STEPS" }}
- name: {{ $env }}
  value: {{ index $s $key | int64 | quote }}
{{- end }}
{{- range $key, $env := dict "maxCacheBytes" "GQA_MAX_CACHE_BYTES" "maxMessageBytes" "GQA_MAX_MESSAGE_BYTES" "inlineStepBytes" "GQA_INLINE_STEP_BYTES" "maxQueuedBytes" "GQA_MAX_QUEUED_BYTES" }}
- name: {{ $env }}
  value: {{ include "gqa-serve.bytes" (list (index $s $key) (printf "server.%s" $key)) | quote }}
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
{{- with .Values.auth.existingSecret }}
- name: GQA_AUTH_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.auth.secretKey }}
{{- end }}
{{- with .Values.snapshotKey.existingSecret }}
- name: GQA_SNAPSHOT_KEY
  valueFrom:
    secretKeyRef:
      name: {{ . }}
      key: {{ $.Values.snapshotKey.secretKey }}
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

{{/*
Labels of the `helm test` pod, which the NetworkPolicy lets reach gRPC.
*/}}
{{- define "gqa-serve.testSelectorLabels" -}}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: test
{{- end }}
