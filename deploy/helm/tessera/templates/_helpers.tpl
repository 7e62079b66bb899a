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
{{- if .Values.dra.enabled -}}
{{- fail "dra.enabled: the chart does not template the DRA plugin yet; install deploy/dra/ (DaemonSet, RBAC, DeviceClasses) beside a release with devicePlugin.enabled=false" -}}
{{- end -}}
{{- if not (has .Values.arbiter.enforce (list "kill" "report")) -}}
{{- fail (printf "arbiter.enforce must be kill or report, not %q" .Values.arbiter.enforce) -}}
{{- end -}}
{{- if not (has .Values.arbiter.unknownProcesses (list "kill" "report" "ignore")) -}}
{{- fail (printf "arbiter.unknownProcesses must be kill, report or ignore, not %q" .Values.arbiter.unknownProcesses) -}}
{{- end -}}
{{- end -}}
