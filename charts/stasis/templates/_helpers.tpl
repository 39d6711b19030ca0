{{- define "stasis.labels" -}}
app.kubernetes.io/name: stasis
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "stasis.selector" -}}
app.kubernetes.io/name: stasis
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "stasis.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
