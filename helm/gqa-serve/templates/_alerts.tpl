{{/*
The alert rules, from .Values.alerts. Rendered into the PrometheusRule, and with the chart's
defaults into rules/gqa-serve-alerts.yaml (helm/tools/generate.py) for promtool's unit tests.
Every expression keeps job, namespace and instance, so an alert names its pod. Prometheus'
own template syntax is escaped as {{`{{ ... }}`}}.
*/}}
{{- define "gqa-serve.alertSelector" -}}
job="{{ include "gqa-serve.name" . }}",namespace="{{ .Release.Namespace }}"
{{- end }}

{{- define "gqa-serve.percent" -}}
{{- printf "%.4g%%" (mulf . 100.0) -}}
{{- end }}

{{- define "gqa-serve.alertRule" -}}
{{- $root := index . 0 -}}
{{- $name := index . 1 -}}
{{- $cfg := index . 2 -}}
- alert: {{ $name }}
  expr: |
    {{- index . 3 | trim | nindent 4 }}
  for: {{ $cfg.for }}
  labels:
    severity: {{ $cfg.severity }}
    {{- if gt (len .) 6 }}
    {{- toYaml (index . 6) | nindent 4 }}
    {{- end }}
    {{- with $root.Values.alerts.labels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    summary: {{ index . 4 | quote }}
    description: {{ index . 5 | quote }}
    runbook_url: {{ printf "%s#%s" $root.Values.alerts.runbookUrl (lower $name) | quote }}
{{- end }}

{{- define "gqa-serve.alertRules" -}}
{{- $a := .Values.alerts -}}
{{- $sel := include "gqa-serve.alertSelector" . -}}
{{- $by := "job, namespace, instance" -}}
groups:
  - name: gqa-serve
    rules:
      {{- $expr := printf "histogram_quantile(0.99,\n  sum by (%s, le) (rate(gqa_step_queue_seconds_bucket{%s}[5m]))\n) > %v" $by $sel $a.queueWait.p99Seconds }}
      {{- include "gqa-serve.alertRule" (list . "GqaQueueWaitHigh" $a.queueWait $expr
          (printf "gqa-serve: p99 queue wait above %vs on {{ $labels.instance }}" $a.queueWait.p99Seconds)
          (printf "Steps wait {{ $value | humanizeDuration }} (p99 over 5m) for a compute worker before they start: the pod has more work than workers. Confirm on the dashboard: p99 queue wait by pod, Worker utilisation by pod.")) | nindent 6 }}
      {{- $codes := join "|" $a.rpcErrors.codes }}
      {{- $expr = printf "sum by (%s) (\n  rate(grpc_server_handled_total{%s,grpc_service=\"gqa.v1.AttentionService\",grpc_code=~\"%s\"}[5m])\n)\n/\nsum by (%s) (\n  rate(grpc_server_handled_total{%s,grpc_service=\"gqa.v1.AttentionService\"}[5m])\n) > %v" $by $sel $codes $by $sel $a.rpcErrors.ratio }}
      {{- include "gqa-serve.alertRule" (list . "GqaRpcErrorRatioHigh" $a.rpcErrors $expr
          (printf "gqa-serve: more than %s of RPCs fail on {{ $labels.instance }}" (include "gqa-serve.percent" $a.rpcErrors.ratio))
          (printf "{{ $value | humanizePercentage }} of AttentionService RPCs ended with %s over 5m (the dashboard's Error ratio panel). Check the pod's log for tracebacks." (join ", " $a.rpcErrors.codes))) | nindent 6 }}
      {{- $outcomes := join "|" $a.stepErrors.outcomes }}
      {{- $expr = printf "sum by (%s) (rate(gqa_steps_total{%s,outcome=~\"%s\"}[5m]))\n/\nsum by (%s) (rate(gqa_steps_total{%s}[5m])) > %v" $by $sel $outcomes $by $sel $a.stepErrors.ratio }}
      {{- include "gqa-serve.alertRule" (list . "GqaStepErrorRatioHigh" $a.stepErrors $expr
          (printf "gqa-serve: more than %s of decode steps fail on {{ $labels.instance }}" (include "gqa-serve.percent" $a.stepErrors.ratio))
          (printf "{{ $value | humanizePercentage }} of decode steps were refused in-band with %s over 5m (the dashboard's Step error ratio panel). Check the pod's log for tracebacks." (join ", " $a.stepErrors.outcomes))) | nindent 6 }}
      {{- $expr = printf "(\n  sum by (%s) (rate(gqa_compute_busy_seconds_total{%s}[5m]))\n  /\n  sum by (%s) (gqa_compute_workers{%s})\n) > %v\nor\nsum by (%s) (avg_over_time(gqa_steps_waiting{%s}[5m])) > %v" $by $sel $by $sel $a.saturation.busyFraction $by $sel $a.saturation.stepsWaiting }}
      {{- include "gqa-serve.alertRule" (list . "GqaSaturated" $a.saturation $expr
          "gqa-serve: compute workers saturated on {{ $labels.instance }}"
          (printf "The compute workers are busy more than %s of the time, or more than %v steps wait for one on average (now {{ printf \"%%.2f\" $value }}), for %s: steps queue and their latency grows with the load. Scale out." (include "gqa-serve.percent" $a.saturation.busyFraction) $a.saturation.stepsWaiting $a.saturation.for)) | nindent 6 }}
      {{- $expr = printf "sum by (%s, reason) (\n  rate(gqa_stream_open_refusals_total{%s,reason=~\"budget|streams|memory\"}[5m])\n) > %v" $by $sel $a.opensRefused.perSecond }}
      {{- include "gqa-serve.alertRule" (list . "GqaStreamOpensRefused" $a.opensRefused $expr
          "gqa-serve refuses stream opens ({{ $labels.reason }}) on {{ $labels.instance }}"
          "{{ $value | humanize }} opens per second are refused for reason {{ $labels.reason }}: the pod is full. Scale out, or raise --max-streams / --max-cache-bytes.") | nindent 6 }}
      {{- $expr = printf "max by (%s) (gqa_cache_reserved_bytes{%s} / gqa_cache_budget_bytes{%s}) > %v\nor\nsum by (%s) (gqa_active_streams{%s})\n  / max by (%s) (gqa_streams_limit{%s}) > %v" $by $sel $sel $a.budget.fraction $by $sel $by $sel $a.budget.fraction }}
      {{- include "gqa-serve.alertRule" (list . "GqaBudgetNearlyExhausted" $a.budget $expr
          (printf "gqa-serve: over %s of the cache budget or stream limit in use on {{ $labels.instance }}" (include "gqa-serve.percent" $a.budget.fraction))
          "{{ $value | humanizePercentage }} of the cache budget (--max-cache-bytes) or of --max-streams is taken by open streams: new streams will soon be refused with RESOURCE_EXHAUSTED.") | nindent 6 }}
      {{- $expr = printf "up{%s} == 0" $sel }}
      {{- include "gqa-serve.alertRule" (list . "GqaTargetDown" $a.targetDown $expr
          "gqa-serve: {{ $labels.instance }} cannot be scraped"
          (printf "Prometheus has failed to scrape {{ $labels.instance }} for %s: the pod is down, restarting, or its metrics port is blocked." $a.targetDown.for)) | nindent 6 }}
      {{- /* absent() of a comparison has no labels: the rule adds job and namespace for routing. */}}
      {{- $expr = printf "absent(up{%s} == 1)" $sel }}
      {{- include "gqa-serve.alertRule" (list . "GqaTargetAbsent" $a.targetAbsent $expr
          (printf "gqa-serve: no pod of job %s in namespace %s is scraped" (include "gqa-serve.name" .) .Release.Namespace)
          (printf "For %s Prometheus has had no target of this release that is up: every pod is down, or scraping is misconfigured (ServiceMonitor selector, NetworkPolicy)." $a.targetAbsent.for)
          (dict "job" (include "gqa-serve.name" .) "namespace" .Release.Namespace)) | nindent 6 }}
{{- end }}
