{{/* Labels every object of the chart carries. */}}
{{- define "tessera.labels" -}}
app.kubernetes.io/part-of: tessera
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{/* The node pods' selector labels (the Service and ServiceMonitor select them too). */}}
{{- define "tessera.selectorLabels" -}}
app.kubernetes.io/name: tessera-node
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "tessera.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "tessera.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{ .Values.serviceAccount.name | default "tessera-node" }}
{{- else -}}
{{ .Values.serviceAccount.name | default "default" }}
{{- end -}}
{{- end -}}

{{/* Fails the render on values the agents would refuse at start-up anyway. */}}
{{- define "tessera.validate" -}}
{{- if not (or .Values.devicePlugin.enabled .Values.dra.enabled) -}}
{{- fail "enable devicePlugin.enabled (extended resource tessera.dev/gpu-shares) or dra.enabled (DRA driver gpu.tessera.dev): without either no pod gets a GPU through Tessera" -}}
{{- end -}}
{{- if .Values.dra.enabled -}}
{{- range .Values.dra.deviceClasses -}}
{{- if not .name -}}
{{- fail "dra.deviceClasses: every class needs a name" -}}
{{- end -}}
{{- if and .tier (not (has .tier (list "best-effort" "latency"))) -}}
{{- fail (printf "dra.deviceClasses %s: tier must be best-effort or latency, not %q" .name .tier) -}}
{{- end -}}
{{- end -}}
{{- if or (le (int .Values.dra.defaultMemoryMiB) 0) (ne (mod (int .Values.dra.defaultMemoryMiB) 256) 0) -}}
{{- fail (printf "dra.defaultMemoryMiB must be a positive multiple of 256, not %v" .Values.dra.defaultMemoryMiB) -}}
{{- end -}}
{{- end -}}
{{- if or (lt (int .Values.devicePlugin.latencyShares) 0) (ge (int .Values.devicePlugin.latencyShares) (int .Values.devicePlugin.sharesPerGpu)) -}}
{{- fail (printf "devicePlugin.latencyShares must be 0 (off) up to sharesPerGpu - 1 (%d), not %v" (sub (int .Values.devicePlugin.sharesPerGpu) 1) .Values.devicePlugin.latencyShares) -}}
{{- end -}}
{{- if and (gt (int .Values.devicePlugin.latencyShares) 0) (eq .Values.devicePlugin.latencyResourceName .Values.devicePlugin.resourceName) -}}
{{- fail "devicePlugin.latencyResourceName must differ from devicePlugin.resourceName" -}}
{{- end -}}
{{- with .Values.devicePlugin.nvidiaCdiKind -}}
{{- if not (regexMatch "^[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?/[A-Za-z]([A-Za-z0-9_.-]*[A-Za-z0-9])?$" .) -}}
{{- fail (printf "devicePlugin.nvidiaCdiKind must be empty (off) or a CDI kind <vendor>/<class> such as nvidia.com/gpu, not %q" .) -}}
{{- end -}}
{{- end -}}
{{- /* Both containers listen on the pod's address: one port each (JSON schema cannot compare two values). */ -}}
{{- if and .Values.devicePlugin.enabled (eq (int .Values.arbiter.metricsPort) (int .Values.devicePlugin.metricsPort)) -}}
{{- fail (printf "arbiter.metricsPort and devicePlugin.metricsPort are both %v: the two containers share the pod's address, so the second could not listen; choose two ports" .Values.arbiter.metricsPort) -}}
{{- end -}}
{{- if not (has .Values.arbiter.enforce (list "kill" "report")) -}}
{{- fail (printf "arbiter.enforce must be kill or report, not %q" .Values.arbiter.enforce) -}}
{{- end -}}
{{- if not (has .Values.arbiter.unknownProcesses (list "kill" "report" "ignore")) -}}
{{- fail (printf "arbiter.unknownProcesses must be kill, report or ignore, not %q" .Values.arbiter.unknownProcesses) -}}
{{- end -}}
{{- end -}}
