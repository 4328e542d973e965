{{- define "bootstrap-controller.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "bootstrap-controller.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else if contains (include "bootstrap-controller.name" .) .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name (include "bootstrap-controller.name" .) | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}

{{- define "bootstrap-controller.selectorLabels" -}}
app.kubernetes.io/name: {{ include "bootstrap-controller.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "bootstrap-controller.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "bootstrap-controller.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "bootstrap-controller.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "bootstrap-controller.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Lease namespace of leader election and of the membership Leases. */}}
{{- define "bootstrap-controller.leaseNamespace" -}}
{{- $le := default dict .Values.config.leaderElection -}}
{{- default "kube-system" $le.leaseNamespace -}}
{{- end }}

{{- define "bootstrap-controller.membershipNamespace" -}}
{{- $loops := default dict .Values.config.loops -}}
{{- $ep := default dict $loops.apiserverEndpoints -}}
{{- default "kube-system" $ep.leaseNamespace -}}
{{- end }}

{{- define "bootstrap-controller.servicesNamespace" -}}
{{- $loops := default dict .Values.config.loops -}}
{{- $svc := default dict $loops.kubernetesService -}}
{{- default "default" $svc.namespace -}}
{{- end }}

{{/* The container's arguments: the config file, and what only a flag or the chart knows. */}}
{{- define "bootstrap-controller.args" -}}
- run
- --config=/etc/bootstrap-controller/config.yaml
- --admin-addr=0.0.0.0:{{ .Values.adminPort }}
{{- if .Values.targetKubeconfig.secretName }}
- --kubeconfig=/etc/bootstrap-controller/target/{{ .Values.targetKubeconfig.key }}
{{- end }}
{{- if .Values.etcd.servers }}
- --etcd-servers={{ join "," .Values.etcd.servers }}
- --etcd-prefix={{ .Values.etcd.prefix }}
{{- if .Values.etcd.certificatesSecret }}
- --etcd-cafile=/etc/bootstrap-controller/etcd/ca.crt
- --etcd-certfile=/etc/bootstrap-controller/etcd/tls.crt
- --etcd-keyfile=/etc/bootstrap-controller/etcd/tls.key
{{- end }}
{{- end }}
{{- with .Values.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}
