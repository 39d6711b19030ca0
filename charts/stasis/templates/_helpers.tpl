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

{{- /* The Secret that holds the site key: the site's own, or the one the chart makes. */ -}}
{{- define "stasis.siteKeySecret" -}}
{{- if .Values.siteKey.existingSecret -}}
{{ .Values.siteKey.existingSecret }}
{{- else if .Values.siteKey.value -}}
{{ .Release.Name }}-site-key
{{- end -}}
{{- end -}}

{{- /* Secrets are mounted one file at a time (subPath): a Secret volume's files are links
     into its ..data directory, and the daemon opens key files without following links. */ -}}
{{- define "stasis.secretsDir" -}}/etc/stasis-secrets{{- end -}}
