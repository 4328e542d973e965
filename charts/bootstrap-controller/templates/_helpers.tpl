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
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{- define "bootstrap-controller.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "bootstrap-controller.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Lease namespace of leader election and of the membership Leases. In management mode,
where each replica writes a Lease of its own there (and may delete another's), the release's
namespace unless one is configured, so that the Role writing them covers no other component's
Leases. */}}
{{- define "bootstrap-controller.leaseNamespace" -}}
{{- $le := default dict .Values.config.leaderElection -}}
{{- if .Values.tenants.enabled -}}
{{- default .Release.Namespace $le.leaseNamespace -}}
{{- else -}}
{{- default "kube-system" $le.leaseNamespace -}}
{{- end -}}
{{- end }}

{{/* The endpoint reconciler type in effect: left unset, the binary builds no endpoints loop and
leaves the endpoints alone, as with `none`. */}}
{{- define "bootstrap-controller.endpointMode" -}}
{{- default "none" .Values.config.endpointReconcilerType -}}
{{- end }}

{{/* The namespace of the membership Leases (`lease` mode): the one configured, else the
release's own, so that the Role writing them covers no other component's Leases. */}}
{{- define "bootstrap-controller.membershipNamespace" -}}
{{- $loops := default dict .Values.config.loops -}}
{{- $ep := default dict $loops.apiserverEndpoints -}}
{{- default .Release.Namespace $ep.leaseNamespace -}}
{{- end }}

{{/* The configuration file: config, with the membership Lease namespace (and in management
mode the replicas' Lease namespace) made explicit; in management mode with the tenants' cache
budgets, which have no environment variable. */}}
{{- define "bootstrap-controller.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- if .Values.tenants.enabled -}}
{{- $le := default dict $config.leaderElection -}}
{{- $_ := set $le "leaseNamespace" (include "bootstrap-controller.leaseNamespace" .) -}}
{{- $_ := set $config "leaderElection" $le -}}
{{- with .Values.tenants.cacheBudgets -}}
{{- $_ := set $config "tenants" (dict "cacheBudgets" .) -}}
{{- end -}}
{{- end -}}
{{- if eq (include "bootstrap-controller.endpointMode" .) "lease" -}}
{{- $loops := default dict $config.loops -}}
{{- $ep := default dict $loops.apiserverEndpoints -}}
{{- $_ := set $ep "leaseNamespace" (include "bootstrap-controller.membershipNamespace" .) -}}
{{- $_ := set $loops "apiserverEndpoints" $ep -}}
{{- $_ := set $config "loops" $loops -}}
{{- end -}}
{{- toYaml $config -}}
{{- end }}

{{- define "bootstrap-controller.servicesNamespace" -}}
{{- $loops := default dict .Values.config.loops -}}
{{- $svc := default dict $loops.kubernetesService -}}
{{- default "default" $svc.namespace -}}
{{- end }}

{{/* The image reference: by digest when one is given. */}}
{{- define "bootstrap-controller.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ $tag }}
{{- end -}}
{{- end }}

{{/* The priority class: system-cluster-critical only in kube-system unless one is named (quota
elsewhere refuses it on managed clusters). */}}
{{- define "bootstrap-controller.priorityClassName" -}}
{{- if .Values.priorityClassName -}}
{{ .Values.priorityClassName }}
{{- else if eq .Release.Namespace "kube-system" -}}
system-cluster-critical
{{- end -}}
{{- end }}

{{/* The subjects of every binding: rbac.subjects, or this release's ServiceAccount. */}}
{{- define "bootstrap-controller.subjects" -}}
{{- if .Values.rbac.subjects }}
{{- range .Values.rbac.subjects }}
- kind: {{ .kind }}
  name: {{ .name | quote }}
  {{- if eq .kind "ServiceAccount" }}
  namespace: {{ required "rbac.subjects: a ServiceAccount subject needs its namespace" .namespace }}
  {{- else }}
  apiGroup: rbac.authorization.k8s.io
  {{- end }}
{{- end }}
{{- else }}
- kind: ServiceAccount
  name: {{ include "bootstrap-controller.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
{{- end }}

{{/* Where the etcd CA is mounted: its own Secret's directory, or the client certificate's. */}}
{{- define "bootstrap-controller.etcdCADir" -}}
{{- if and .Values.etcd.caSecret (ne .Values.etcd.caSecret .Values.etcd.certificatesSecret) -}}
/etc/bootstrap-controller/etcd-ca
{{- else -}}
/etc/bootstrap-controller/etcd
{{- end -}}
{{- end }}

{{/* The settings, as the environment variables the binary reads for each flag: `kubectl exec
... bootstrap-controller check` inherits them, where container arguments would not reach it. */}}
{{- define "bootstrap-controller.settingsEnv" -}}
- name: BOOTSTRAP_CONFIG
  value: /etc/bootstrap-controller/config.yaml
- name: BOOTSTRAP_ADMIN_ADDR
  value: {{ .Values.config.adminAddr | default (printf "0.0.0.0:%d" (int .Values.adminPort)) | quote }}
{{- if .Values.targetKubeconfig.secretName }}
- name: BOOTSTRAP_KUBECONFIG
  value: /etc/bootstrap-controller/target/{{ .Values.targetKubeconfig.key }}
{{- end }}
{{- if .Values.tenants.enabled }}
- name: BOOTSTRAP_TENANTS_SECRET_SELECTOR
  value: {{ .Values.tenants.secretSelector | quote }}
{{- if not .Values.tenants.allNamespaces }}
- name: BOOTSTRAP_TENANTS_NAMESPACE
  value: {{ .Values.tenants.namespace | quote }}
{{- end }}
- name: BOOTSTRAP_TENANTS_KUBECONFIG_KEY
  value: {{ .Values.tenants.kubeconfigKey | quote }}
{{- if .Values.tenants.credentialPlugins }}
- name: BOOTSTRAP_TENANTS_CREDENTIAL_PLUGINS
  value: {{ join "," .Values.tenants.credentialPlugins | quote }}
{{- end }}
- name: BOOTSTRAP_TENANTS_CACHE_MAX_OBJECTS
  value: {{ .Values.tenants.cacheMaxObjects | int64 | quote }}
- name: BOOTSTRAP_TENANTS_CACHE_MAX_MIB
  value: {{ .Values.tenants.cacheMaxMiB | int64 | quote }}
- name: BOOTSTRAP_TENANTS_CACHE_TOTAL_MIB
  value: {{ .Values.tenants.cacheTotalMiB | int64 | quote }}
- name: BOOTSTRAP_TENANTS_SECRETS_TOTAL_MIB
  value: {{ .Values.tenants.secretsTotalMiB | int64 | quote }}
{{- if .Values.tenants.etcdAllowedCIDRs }}
- name: BOOTSTRAP_TENANTS_ETCD_ALLOWED_CIDRS
  value: {{ join "," .Values.tenants.etcdAllowedCIDRs | quote }}
{{- end }}
{{- end }}
{{- if .Values.etcd.servers }}
- name: BOOTSTRAP_ETCD_SERVERS
  value: {{ join "," .Values.etcd.servers | quote }}
- name: BOOTSTRAP_ETCD_PREFIX
  value: {{ .Values.etcd.prefix | quote }}
{{- if .Values.etcd.certificatesSecret }}
- name: BOOTSTRAP_ETCD_CAFILE
  value: {{ include "bootstrap-controller.etcdCADir" . }}/{{ .Values.etcd.caKey }}
- name: BOOTSTRAP_ETCD_CERTFILE
  value: /etc/bootstrap-controller/etcd/tls.crt
- name: BOOTSTRAP_ETCD_KEYFILE
  value: /etc/bootstrap-controller/etcd/tls.key
{{- else if .Values.etcd.caSecret }}
- name: BOOTSTRAP_ETCD_CAFILE
  value: {{ include "bootstrap-controller.etcdCADir" . }}/{{ .Values.etcd.caKey }}
{{- end }}
{{- end }}
{{- end }}

{{/* Combinations the schema cannot refuse. */}}
{{- define "bootstrap-controller.validate" -}}
{{- include "bootstrap-controller.validateConfig" . -}}
{{- $le := default dict .Values.config.leaderElection -}}
{{- if and (gt (int .Values.replicaCount) 1) (eq (toString $le.enabled) "false") -}}
{{- fail (printf "replicaCount is %d with config.leaderElection.enabled=false: every replica would write the same objects. Set replicaCount=1, or turn leader election on." (int .Values.replicaCount)) -}}
{{- end -}}
{{- if .Values.tenants.enabled -}}
{{- if not .Values.tenants.secretSelector -}}
{{- fail "tenants.enabled=true needs tenants.secretSelector: the label selector of the Secrets holding the tenant kubeconfigs (e.g. cluster.x-k8s.io/cluster-name for Cluster API)." -}}
{{- end -}}
{{- if and .Values.tenants.allNamespaces .Values.tenants.namespace -}}
{{- fail (printf "tenants.namespace=%s and tenants.allNamespaces=true contradict each other: keep the namespace (Secret read only there), or leave it empty to watch every namespace." .Values.tenants.namespace) -}}
{{- end -}}
{{- if not (or .Values.tenants.namespace .Values.tenants.allNamespaces) -}}
{{- fail "tenants.enabled=true needs tenants.namespace: the namespace of the tenant Secrets, the only one where the chart grants Secret read. To watch every namespace (a ClusterRole reading every Secret of the cluster), set tenants.allNamespaces=true instead." -}}
{{- end -}}
{{- if .Values.etcd.servers -}}
{{- fail "etcd.servers with tenants.enabled=true: one etcd would be shared by every tenant, and the controller refuses process-wide etcd settings in management mode. Give each tenant its etcdServers and etcdPrefix in the bootstrap-controller.io/config annotation of its Secret and its client certificate in the Secret's data keys etcd-ca.crt, etcd-client.crt and etcd-client.key, and leave etcd.servers empty." -}}
{{- end -}}
{{- range $key := list "etcdServers" "etcdPrefix" "etcdCAFile" "etcdCertFile" "etcdKeyFile" -}}
{{- if hasKey $.Values.config $key -}}
{{- fail (printf "config.%s with tenants.enabled=true: the controller refuses process-wide etcd settings in management mode. Set etcdServers and etcdPrefix per tenant in the bootstrap-controller.io/config annotation of its Secret, its client certificate in the Secret's data keys etcd-ca.crt, etcd-client.crt and etcd-client.key." $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* settingsEnv hands these to the binary as environment variables, which win over the
configuration file: the file's value would be ignored without a word. */ -}}
{{- if .Values.etcd.servers -}}
{{- $instead := dict "etcdServers" "etcd.servers" "etcdPrefix" "etcd.prefix" "etcdCAFile" "etcd.caSecret and etcd.caKey" "etcdCertFile" "etcd.certificatesSecret" "etcdKeyFile" "etcd.certificatesSecret" -}}
{{- range $key, $value := $instead -}}
{{- if hasKey $.Values.config $key -}}
{{- fail (printf "config.%s with etcd.servers set: set %s instead. The chart passes etcd.* to the controller as environment variables, which win over the configuration file, so config.%s would be ignored." $key $value $key) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- if and .Values.targetKubeconfig.secretName (hasKey .Values.config "kubeconfig") -}}
{{- fail "config.kubeconfig with targetKubeconfig.secretName set: set targetKubeconfig.key instead (the key of the kubeconfig in that Secret). The chart passes the mounted kubeconfig to the controller as BOOTSTRAP_KUBECONFIG, which wins over the configuration file, so config.kubeconfig would be ignored." -}}
{{- end -}}
{{- if and .Values.targetKubeconfig.secretName .Values.rbac.create (not .Values.rbac.subjects) -}}
{{- fail "targetKubeconfig.secretName with rbac.create=true and no rbac.subjects: the bindings would grant the release's ServiceAccount, which the pods do not use (they reach the cluster with the target kubeconfig). Set rbac.create=false and apply the RBAC in the target cluster (the chart README, Hosted control planes), or name the kubeconfig's identity in rbac.subjects." -}}
{{- end -}}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) -}}
{{- fail "metrics.serviceMonitor.enabled=true scrapes the metrics Service, but metrics.service.enabled=false renders none. Turn metrics.service.enabled on, or the ServiceMonitor off." -}}
{{- end -}}
{{- end }}
