{{/* The release's name for its objects (release-chart, or the release alone if it holds the chart's). */}}
{{- define "rollfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "rollfleet.labels" -}}
app.kubernetes.io/name: rollfleet
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "rollfleet.selector" -}}
app.kubernetes.io/name: rollfleet
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The broker's URL: given, or the NATS chart's client Service (named after the release). */}}
{{- define "rollfleet.brokerUrl" -}}
{{- if .Values.brokerUrl -}}
{{- .Values.brokerUrl -}}
{{- else -}}
{{- printf "nats://%s-nats:4222" .Release.Name -}}
{{- end -}}
{{- end -}}

{{/* Flags every rollfleet process of the fleet shares: the broker, the run namespace, and the
     topology it declares when the namespace is missing (streams at streamReplicas). */}}
{{- define "rollfleet.brokerArgs" -}}
- --nats
- {{ include "rollfleet.brokerUrl" . | quote }}
- --namespace
- {{ .Values.runNamespace | quote }}
{{- if gt (int .Values.streamReplicas) 1 }}
- --replicas
- {{ .Values.streamReplicas | quote }}
{{- end }}
{{- end -}}

{{- define "rollfleet.image" -}}
{{ printf "%s:%s" .Values.image.repository .Values.image.tag | quote }}
{{- end -}}

{{/* The worker container's arguments: docker-compose.yml's worker command. */}}
{{- define "rollfleet.workerArgs" -}}
- worker
- --engine
- {{ .Values.worker.engine | quote }}
{{ include "rollfleet.brokerArgs" . }}
- --store
- {{ .Values.store.url | default .Values.store.path | quote }}
- --local-dir
- /home/rollfleet/replica
- --catch-up-wait
- "86400"
{{- if .Values.worker.server.enabled }}
- {{ printf "--%s-url" .Values.worker.engine | quote }}
- {{ printf "http://127.0.0.1:%v" .Values.worker.server.port | quote }}
{{- end }}
{{- range .Values.worker.extraArgs }}
- {{ . | quote }}
{{- end }}
{{- end -}}
