{{/*
The checks of the binary's `config validate` that the values schema cannot express, so that
`helm install` refuses what would crash-loop the pods. Each message names the value as
`config.<key>` and says what fits. e2e/packaging/invalid_configs.yaml lists every refusal; its
test runs each row through this chart and through the binary.
*/}}

{{/* A Go duration ("1m30s", "500ms") in milliseconds; the schema has checked its shape. */}}
{{- define "bootstrap-controller.durationMs" -}}
{{- $units := dict "ns" 0.000001 "us" 0.001 "µs" 0.001 "ms" 1.0 "s" 1000.0 "m" 60000.0 "h" 3600000.0 -}}
{{- $total := 0.0 -}}
{{- range regexFindAll "[0-9]+(\\.[0-9]+)?(ns|us|µs|ms|s|m|h)" (toString .) -1 -}}
{{- $number := regexFind "^[0-9]+(\\.[0-9]+)?" . -}}
{{- $unit := trimPrefix $number . -}}
{{- $total = addf $total (mulf (float64 $number) (get $units $unit)) -}}
{{- end -}}
{{- $total -}}
{{- end }}

{{/* What is wrong with one service range (empty when nothing is), as the binary words it. */}}
{{- define "bootstrap-controller.cidrProblem" -}}
{{- $cidr := trim (toString .) -}}
{{- if regexMatch "^[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}\\.[0-9]{1,3}/[0-9]{1,3}$" $cidr -}}
{{- $parts := regexSplit "[./]" $cidr -1 -}}
{{- $prefix := int (index $parts 4) -}}
{{- $address := 0 -}}
{{- $octetTooLarge := false -}}
{{- range $i := until 4 -}}
{{- $octet := int (index $parts $i) -}}
{{- if gt $octet 255 -}}{{- $octetTooLarge = true -}}{{- end -}}
{{- $address = add (mul $address 256) $octet -}}
{{- end -}}
{{- if or $octetTooLarge (gt $prefix 32) -}}
"{{ $cidr }}" is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)
{{- else if gt $prefix 29 -}}
{{ $cidr }} holds fewer than 8 addresses (use a larger range, e.g. /29 or shorter)
{{- else -}}
{{- $block := 1 -}}
{{- range until (sub 32 $prefix | int) -}}{{- $block = mul $block 2 -}}{{- end -}}
{{- if ne (mod $address $block) 0 -}}
"{{ $cidr }}" has host bits set (the network address of a /{{ $prefix }} is a multiple of {{ $block }} addresses)
{{- end -}}
{{- end -}}
{{- else if regexMatch "^([0-9a-fA-F]{0,4}:){2,7}[0-9a-fA-F]{0,4}/[0-9]{1,3}$" $cidr -}}
{{- $prefix := int (regexFind "[0-9]+$" $cidr) -}}
{{- if gt $prefix 128 -}}
"{{ $cidr }}" is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)
{{- else if gt $prefix 125 -}}
{{ $cidr }} holds fewer than 8 addresses (use a larger range, e.g. /125 or shorter)
{{- end -}}
{{- else -}}
"{{ $cidr }}" is not a valid CIDR (expected e.g. 10.96.0.0/12 or fd00:10:96::/108)
{{- end -}}
{{- end }}

{{- define "bootstrap-controller.validateConfig" -}}
{{- /* Keys users of other charts look for at the top, refused with where they live here (the
schema lets them through to this check, which can say so). */ -}}
{{- $misplaced := dict "serviceMonitor" "metrics.serviceMonitor" "prometheusRule" "metrics.prometheusRule" "dashboard" "metrics.dashboard" "service" "metrics.service" "securePort" "config.securePort" "serviceClusterIPRange" "config.serviceClusterIPRange" "serviceNodePortRange" "config.serviceNodePortRange" "endpointReconcilerType" "config.endpointReconcilerType" "advertiseAddress" "config.advertiseAddress" "leaderElection" "config.leaderElection" "dryRun" "config.dryRun" "loops" "config.loops" "kubeconfig" "targetKubeconfig" -}}
{{- range $key, $place := $misplaced -}}
{{- if hasKey $.Values $key -}}
{{- fail (printf "%s is not a value at the top of this chart: it lives at %s. Move it there (e.g. --set %s=...)." $key $place $place) -}}
{{- end -}}
{{- end -}}
{{- $config := .Values.config -}}
{{- $loops := default dict $config.loops -}}
{{- $endpoints := default dict $loops.apiserverEndpoints -}}
{{- $mode := include "bootstrap-controller.endpointMode" . -}}

{{- $ranges := list -}}
{{- if $config.serviceClusterIPRange -}}
{{- if kindIs "slice" $config.serviceClusterIPRange -}}
{{- $ranges = $config.serviceClusterIPRange -}}
{{- else -}}
{{- $ranges = splitList "," (toString $config.serviceClusterIPRange) -}}
{{- end -}}
{{- if gt (len $ranges) 2 -}}
{{- fail (printf "config.serviceClusterIPRange: lists %d ranges; at most two are allowed, one IPv4 and one IPv6 (e.g. 10.96.0.0/12,fd00:10:96::/108)" (len $ranges)) -}}
{{- end -}}
{{- range $ranges -}}
{{- $problem := include "bootstrap-controller.cidrProblem" . -}}
{{- if $problem -}}
{{- fail (printf "config.serviceClusterIPRange: %s" $problem) -}}
{{- end -}}
{{- end -}}
{{- if and (eq (len $ranges) 2) (eq (contains ":" (index $ranges 0)) (contains ":" (index $ranges 1))) -}}
{{- fail (printf "config.serviceClusterIPRange: lists two ranges of one family (%s and %s); a dual-stack range needs one IPv4 and one IPv6 CIDR (e.g. 10.96.0.0/12,fd00:10:96::/108)" (trim (index $ranges 0)) (trim (index $ranges 1))) -}}
{{- end -}}
{{- end -}}

{{- $portRange := toString (default "30000-32767" $config.serviceNodePortRange) -}}
{{- $ports := splitList "-" $portRange -}}
{{- $base := int (index $ports 0) -}}
{{- $last := int (index $ports 1) -}}
{{- if or (lt $base 1) (gt $last 65535) -}}
{{- fail (printf "config.serviceNodePortRange: %q is not a port range of ports 1-65535 (expected BASE-LAST with BASE <= LAST, e.g. 30000-32767)" $portRange) -}}
{{- end -}}
{{- if gt $base $last -}}
{{- fail (printf "config.serviceNodePortRange: %q is inverted: %d is above %d (expected BASE-LAST with BASE <= LAST, e.g. 30000-32767)" $portRange $base $last) -}}
{{- end -}}
{{- $nodePort := int (default 0 $config.kubernetesServiceNodePort) -}}
{{- if and (ne $nodePort 0) (or (lt $nodePort $base) (gt $nodePort $last)) -}}
{{- fail (printf "config.kubernetesServiceNodePort: %d is outside the node port range %s (use 0 for a ClusterIP Service, or a port inside config.serviceNodePortRange)" $nodePort $portRange) -}}
{{- end -}}

{{- /* As `run` refuses them in management mode (controllers/src/config/tenant.rs), in its words. */ -}}
{{- if and .Values.tenants.enabled (has $mode (list "lease" "master-count")) -}}
{{- fail (printf "config.endpointReconcilerType with tenants.enabled=true: %q makes this process one of the tenant's apiservers, which it is not: use static (with the tenant's load-balancer address under loops.apiserverEndpoints) or none" $mode) -}}
{{- end -}}
{{- if and .Values.tenants.enabled (eq $mode "static") -}}
{{- range $index, $entry := ($endpoints.staticAddresses | default list) -}}
{{- if not (or (regexMatch "^[0-9]{1,3}(\\.[0-9]{1,3}){3}$" (toString $entry)) (regexMatch "^[0-9a-fA-F:.]*:[0-9a-fA-F:.]*$" (toString $entry))) -}}
{{- fail (printf "config.loops.apiserverEndpoints.staticAddresses[%d] with tenants.enabled=true: %q is a DNS name, which this process would resolve with the management cluster's DNS and write what it answers into the tenant's endpoints: a tenant lists IP addresses only (its load balancer's, e.g. 192.0.2.40)" $index (toString $entry)) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- /* Both list the advertise address, which in a pod defaults to the pod's own. */ -}}
{{- if and (has $mode (list "lease" "master-count")) (not $config.advertiseAddress) -}}
{{- fail (printf "config.endpointReconcilerType: %s in the chart's Deployment would list each pod's own address in the `kubernetes` endpoints, and every in-cluster client would dial the controller. Use static with the apiservers' (or their load balancer's) addresses in config.loops.apiserverEndpoints.staticAddresses, or the sidecar beside each kube-apiserver (README, Install); set config.advertiseAddress only for an address every replica stands for (a VIP in front of the apiservers)." $mode) -}}
{{- end -}}
{{- if and (eq $mode "static") (not $endpoints.staticAddresses) -}}
{{- fail "config.loops.apiserverEndpoints.staticAddresses: endpointReconcilerType static needs at least one IP address or DNS name (the apiservers' or their load balancer's)" -}}
{{- end -}}
{{- if and $config.advertiseAddress $ranges (ne $mode "none") -}}
{{- $primary := trim (index $ranges 0) -}}
{{- if ne (contains ":" (toString $config.advertiseAddress)) (contains ":" $primary) -}}
{{- fail (printf "config.advertiseAddress: %s is not of the family of the primary service range %s (advertise an address of the primary range's family, or list the other family's range first)" $config.advertiseAddress $primary) -}}
{{- end -}}
{{- end -}}

{{- range $name := list "systemNamespaces" "kubernetesService" "apiserverEndpoints" "serviceCIDR" "clusterIPRepair" "nodePortRepair" -}}
{{- $loop := default dict (get $loops $name) -}}
{{- if and (hasKey $loop "interval") (eq (float64 (include "bootstrap-controller.durationMs" $loop.interval)) 0.0) -}}
{{- fail (printf "config.loops.%s.interval: must be greater than zero (e.g. 10s or 1m)" $name) -}}
{{- end -}}
{{- end -}}
{{- $repair := default dict $loops.clusterIPRepair -}}
{{- if and (hasKey $repair "orphanGracePeriod") (lt (float64 (include "bootstrap-controller.durationMs" $repair.orphanGracePeriod)) 5000.0) -}}
{{- fail "config.loops.clusterIPRepair.orphanGracePeriod: must be at least 5s (upstream uses 60s; shorter risks deleting the IPAddress of a Service that is still being created)" -}}
{{- end -}}
{{- if and (hasKey $config "shutdownTimeout") (eq (float64 (include "bootstrap-controller.durationMs" $config.shutdownTimeout)) 0.0) -}}
{{- fail "config.shutdownTimeout: must be greater than zero (e.g. 30s)" -}}
{{- end -}}
{{- $election := default dict $config.leaderElection -}}
{{- $endpoints := default dict $loops.apiserverEndpoints -}}
{{- $durations := dict "shutdownTimeout" $config.shutdownTimeout "leaderElection.leaseDuration" $election.leaseDuration "leaderElection.renewGrace" $election.renewGrace "loops.apiserverEndpoints.leaseTTL" $endpoints.leaseTTL "loops.apiserverEndpoints.shutdownProbeWindow" $endpoints.shutdownProbeWindow "loops.clusterIPRepair.orphanGracePeriod" $repair.orphanGracePeriod -}}
{{- range $name := list "systemNamespaces" "kubernetesService" "apiserverEndpoints" "serviceCIDR" "clusterIPRepair" "nodePortRepair" -}}
{{- $_ := set $durations (printf "loops.%s.interval" $name) (get (default dict (get $loops $name)) "interval") -}}
{{- end -}}
{{- range $name := list "clusterIPRepair" "nodePortRepair" -}}
{{- $_ := set $durations (printf "loops.%s.leakSightingSpacing" $name) (get (default dict (get $loops $name)) "leakSightingSpacing") -}}
{{- end -}}
{{- range $field, $value := $durations -}}
{{- /* 8760h in milliseconds: the binary's longest duration. */ -}}
{{- if and $value (gt (float64 (include "bootstrap-controller.durationMs" $value)) 31536000000.0) -}}
{{- fail (printf "config.%s: %q is longer than 8760h (365 days), more than any setting needs: give a shorter duration (e.g. 10s, 1m, 24h)" $field (toString $value)) -}}
{{- end -}}
{{- end -}}
{{- /* The schema's maxLength counts characters; an event's reportingInstance holds bytes. */ -}}
{{- $identity := toString (default "" $election.identity) -}}
{{- if gt (len $identity) 128 -}}
{{- fail (printf "config.leaderElection.identity: the identity %q is %d bytes long, more than the 128 an event's reportingInstance holds: set leaderElection.identity to a shorter one (e.g. the pod name)" $identity (len $identity)) -}}
{{- end -}}
{{- $lease := float64 (include "bootstrap-controller.durationMs" (default "15s" $election.leaseDuration)) -}}
{{- if lt $lease 2000.0 -}}
{{- fail "config.leaderElection.leaseDuration: must be at least 2s (e.g. 15s)" -}}
{{- end -}}
{{- if ne (mod (int64 (round $lease 0)) 1000) 0 -}}
{{- fail "config.leaderElection.leaseDuration: must be whole seconds (e.g. 15s): a Lease holds whole seconds" -}}
{{- end -}}
{{- $grace := float64 (include "bootstrap-controller.durationMs" (default "5s" $election.renewGrace)) -}}
{{- if or (lt $grace 1000.0) (ge $grace $lease) -}}
{{- fail (printf "config.leaderElection.renewGrace: must be at least 1s and shorter than the lease duration (%s) (e.g. 5s with a 15s lease)" (default "15s" $election.leaseDuration)) -}}
{{- end -}}

{{- with $config.adminAddr -}}
{{- $admin := toString . -}}
{{- $port := int (regexFind "[0-9]+$" $admin) -}}
{{- if or (not (regexMatch "^([0-9]{1,3}(\\.[0-9]{1,3}){3}|\\[[0-9a-fA-F:.]+\\]):[0-9]{1,5}$" $admin)) (gt $port 65535) -}}
{{- fail (printf "config.adminAddr: %q is not an address:port (expected e.g. 0.0.0.0:8080 or [::]:8080)" $admin) -}}
{{- end -}}
{{- /* The container port, the probes and the metrics Service use adminPort. */ -}}
{{- if ne $port (int $.Values.adminPort) -}}
{{- fail (printf "config.adminAddr: %s listens on port %d, not adminPort (%d), where the probes and the metrics Service reach the admin server: set adminPort=%d too, or use port %d" $admin $port (int $.Values.adminPort) $port (int $.Values.adminPort)) -}}
{{- end -}}
{{- end -}}
{{- end }}
